#!/usr/bin/env python3
# Dev-side only (never run by the build or `make test`): writes the checkpoints of tests/golden/hf/
# that need the newest libraries - what users' files look like today - and transformers' logits
# for them (tests/test_tools.cpp compares ours to 1e-4):
#   python3 -m venv /tmp/qn && /tmp/qn/bin/pip install torch==2.15.0 transformers==5.24.0 \
#       bitsandbytes==0.50.2 accelerate safetensors
#   /tmp/qn/bin/python tests/reference/hf5_golden.py        (after hf_golden.py: it reads llama/)
# - llama-linear: a Llama with linear rope scaling (factor 4) saved by transformers 5, whose
#   config.json holds rope_parameters (theta and scaling together) instead of 4.x's rope_theta /
#   rope_scaling;
# - llama-bnb4-real: a 64-wide Llama loaded with load_in_4bit (NF4, double quantisation) on
#   bitsandbytes' CPU backend and written by the real save_pretrained - the file a user of
#   bitsandbytes has; its logits are fp32 on bitsandbytes' dequantisation of the saved codes.
# Logits file hf5-logits.bin: as logits.bin (n_ids, vocab, ids, then per model: name, logits).
import json, os, shutil, struct
import torch
from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

OUT = 'tests/golden/hf'
torch.manual_seed(20261125)
with open(os.path.join(OUT, 'logits.bin'), 'rb') as f:  # the same positions as hf_golden.py's
    n_ids, V = struct.unpack('<2I', f.read(8))
    ids = list(struct.unpack('<%di' % n_ids, f.read(4 * n_ids)))
out = bytearray(struct.pack('<2I', n_ids, V)) + struct.pack('<%di' % n_ids, *ids)

def add_logits(name, m):
    global out
    with torch.no_grad():
        lg = m(torch.tensor([ids])).logits[0].float()
    out += struct.pack('<I', len(name)) + name.encode() + lg.numpy().astype('<f4').tobytes()

def save(d, model):  # save_pretrained, llama/'s tokenizer beside it, no generation_config.json
    model.save_pretrained(d)
    for f in ('tokenizer.json', 'tokenizer_config.json'):
        shutil.copy(os.path.join(OUT, 'llama', f), os.path.join(d, f))
    if os.path.exists(os.path.join(d, 'generation_config.json')):
        os.remove(os.path.join(d, 'generation_config.json'))

src = json.load(open(os.path.join(OUT, 'llama', 'config.json')))
cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=V, max_position_embeddings=128, rms_norm_eps=1e-5, bos_token_id=src['bos_token_id'],
                  eos_token_id=src['eos_token_id'], tie_word_embeddings=False, rope_theta=20000.0,
                  rope_scaling={'rope_type': 'linear', 'factor': 4.0})
m = LlamaForCausalLM(cfg).eval()
with torch.no_grad():
    for n_, p in m.named_parameters():
        p.normal_(1.0, 0.1) if 'norm' in n_ else p.normal_(0.0, 0.2)
d = os.path.join(OUT, 'llama-linear')
save(d, m)
add_logits('llama-linear', m)
print('llama-linear', json.load(open(os.path.join(d, 'config.json')))['rope_parameters'])

# (64 wide, not llama/'s 32: bitsandbytes' CPU matmul cannot run rows shorter than a block of 64)
torch.manual_seed(11)
cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=V, max_position_embeddings=128, rms_norm_eps=1e-5, bos_token_id=src['bos_token_id'],
                  eos_token_id=src['eos_token_id'], tie_word_embeddings=False, rope_theta=10000.0)
m = LlamaForCausalLM(cfg).eval()
with torch.no_grad():
    for n_, p in m.named_parameters():
        p.normal_(1.0, 0.1) if 'norm' in n_ else p.normal_(0.0, 0.2)
m.save_pretrained('/tmp/hf5-llama64')
q = LlamaForCausalLM.from_pretrained('/tmp/hf5-llama64', device_map='cpu', quantization_config=BitsAndBytesConfig(
    load_in_4bit=True, bnb_4bit_quant_type='nf4', bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.float32)).eval()
d = os.path.join(OUT, 'llama-bnb4-real')
save(d, q)
# the reference logits: transformers' fp32 forward with every 4-bit linear replaced by bitsandbytes'
# own dequantize_4bit of the saved codes (before q runs: its CPU forward repacks the weights). The
# quantised model's own CPU forward is not fp32: it differs from this by ~0.14 of logits up to ~6
# (bitsandbytes' CPU 4-bit matmul rounds through bf16), printed below.
import bitsandbytes as bnb
import bitsandbytes.functional as BF
deq = LlamaForCausalLM.from_pretrained('/tmp/hf5-llama64').eval()
with torch.no_grad():
    mods = dict(deq.named_modules())
    for nm, mod in q.named_modules():
        if isinstance(mod, bnb.nn.Linear4bit):
            mods[nm].weight.data = BF.dequantize_4bit(mod.weight.data, mod.weight.quant_state).to(torch.float32)
add_logits('llama-bnb4-real', deq)
with torch.no_grad():
    print('bitsandbytes CPU forward vs fp32 on its dequantised weights: max |diff| =',
          (q(torch.tensor([ids])).logits[0] - deq(torch.tensor([ids])).logits[0]).abs().max().item())
print('llama-bnb4-real', sorted(os.listdir(d)), json.load(open(os.path.join(d, 'config.json')))['quantization_config'])
with open(os.path.join(OUT, 'hf5-logits.bin'), 'wb') as f:
    f.write(bytes(out))
