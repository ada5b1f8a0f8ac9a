#!/usr/bin/env python3
# Dev-side only: does the real PEFT load qlora's peft/ export and compute what qlora computes?
#   ./convert hf tests/golden/hf/llama -o /tmp/l.gguf
#   ./finetune -m /tmp/l.gguf -d examples/demo.jsonl -o /tmp/lft --lora-targets all --max-steps 30 --lr 1e-2 --seq-len 64
#   ./perplexity -m /tmp/l.gguf -f TEXT --lora /tmp/lft/peft --json        (qlora's nll)
#   /tmp/qv/bin/python tests/reference/peft_export_check.py tests/golden/hf/llama /tmp/lft/peft TEXT
# prints transformers + PEFT's mean nll over TEXT's tokens (BOS first, as ./perplexity's window).
import sys
import torch
from peft import PeftModel
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

base_dir, peft_dir, text_file = sys.argv[1:4]
tok = PreTrainedTokenizerFast(tokenizer_file=base_dir + '/tokenizer.json')
text = open(text_file, encoding='utf-8').read()
ids = [LlamaForCausalLM.config_class.from_pretrained(base_dir).bos_token_id] + tok(text, add_special_tokens=False)['input_ids']
m = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base_dir), peft_dir)
m.eval()
with torch.no_grad():
    logits = m(torch.tensor([ids])).logits[0]
    nll = torch.nn.functional.cross_entropy(logits[:-1].double(), torch.tensor(ids[1:]))
print('tokens', len(ids) - 1, 'ids', ids[:8], '...')
print('{"nll": %.6f}' % nll.item())
