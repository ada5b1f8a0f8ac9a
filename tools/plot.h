// tools/plot.h - finetune's loss curves as a PNG (loss.png). Built into the tools (make: the
// libtools archive; CMake: qlora_tools), not the library: only a program draws pictures.
#pragma once

#include <string>
#include <utility>
#include <vector>

// Loss curves (x: optimizer step) as an 800 x 500 RGB PNG with axes, ticks and a legend; eval
// may be empty (train too, if eval is not). Non-finite values are refused; written atomically.
bool ql_plot_losses(const char *path, const std::vector<std::pair<double, double>> &train,
                    const std::vector<std::pair<double, double>> &eval, std::string *err);
