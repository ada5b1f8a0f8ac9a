#!/usr/bin/env python3
# Dev-side only (never run by the build or `make test`): writes tests/golden/hf/, the Hugging
# Face checkpoints `./convert hf` is checked against, saved by the real transformers, and the
# logits transformers computes for them (tests/test_tools.cpp compares ours to 1e-4).
#   python3 -m venv /tmp/qv && /tmp/qv/bin/pip install torch==2.5.1 transformers==4.46.3 safetensors==0.4.5
#   /tmp/qv/bin/python tests/reference/hf_golden.py
# Three tiny random models: a Llama with GQA, untied head and Llama 3.1 rope scaling; a Qwen2
# with q/k/v biases and a tied head, saved in two shards; a Mistral. One byte-level BPE
# tokenizer.json (Llama 3's split pattern) written here by hand for all three.
import json, os, struct
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM)

OUT = 'tests/golden/hf'
torch.manual_seed(20261124)

def bytes_to_unicode():  # GPT-2's byte -> printable character map
    bs = list(range(ord('!'), ord('~') + 1)) + list(range(ord('¡'), ord('¬') + 1)) + list(range(ord('®'), ord('ÿ') + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))

B2U = bytes_to_unicode()
vocab = {B2U[b]: b for b in range(256)}
merges = []
for pair in [('Ġ', 't'), ('h', 'e'), ('Ġt', 'he'), ('Ġ', 'a'), ('i', 'n'), ('o', 'n')]:
    merges.append(' '.join(pair))
    vocab[pair[0] + pair[1]] = len(vocab)
SPECIAL = ['<|begin_of_text|>', '<|end_of_text|>']
LLAMA3_SPLIT = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
                "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
tokenizer = {
    'version': '1.0',
    'added_tokens': [{'id': len(vocab) + i, 'content': s, 'single_word': False, 'lstrip': False, 'rstrip': False,
                      'normalized': False, 'special': True} for i, s in enumerate(SPECIAL)],
    'normalizer': None,
    'pre_tokenizer': {'type': 'Sequence', 'pretokenizers': [
        {'type': 'Split', 'pattern': {'Regex': LLAMA3_SPLIT}, 'behavior': 'Isolated', 'invert': False},
        {'type': 'ByteLevel', 'add_prefix_space': False, 'trim_offsets': True, 'use_regex': False}]},
    'post_processor': None,
    'decoder': {'type': 'ByteLevel', 'add_prefix_space': True, 'trim_offsets': True, 'use_regex': True},
    'model': {'type': 'BPE', 'dropout': None, 'unk_token': None, 'continuing_subword_prefix': None,
              'end_of_word_suffix': None, 'fuse_unk': False, 'byte_fallback': False, 'ignore_merges': True,
              'vocab': vocab, 'merges': merges},
}
BOS, EOS = len(vocab), len(vocab) + 1
V = len(vocab) + len(SPECIAL) + 6  # the embedding a little larger than the vocabulary: padding tokens

common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=V, max_position_embeddings=128, rms_norm_eps=1e-5, bos_token_id=BOS, eos_token_id=EOS)
models = {
    'llama': LlamaForCausalLM(LlamaConfig(**common, rope_theta=500000.0, tie_word_embeddings=False,
                                          rope_scaling={'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0,
                                                        'high_freq_factor': 4.0, 'original_max_position_embeddings': 32})),
    'qwen2': Qwen2ForCausalLM(Qwen2Config(**common, rope_theta=1000000.0, tie_word_embeddings=True)),
    'mistral': MistralForCausalLM(MistralConfig(**common, rope_theta=10000.0, tie_word_embeddings=False, sliding_window=None)),
}
ids = [BOS] + [(7 * i + 3) % (V - 8) for i in range(23)]  # 24 positions
out = bytearray(struct.pack('<2I', len(ids), V))
out += struct.pack('<%di' % len(ids), *ids)
for name, m in models.items():
    m.eval()
    with torch.no_grad():  # weights of a trained model's magnitude, not the init's 0.02
        for p in m.parameters():
            p.normal_(0.0, 0.2)
        for n_, p in m.named_parameters():
            if 'norm' in n_:
                p.normal_(1.0, 0.1)
    d = os.path.join(OUT, name)
    os.makedirs(d, exist_ok=True)
    m.save_pretrained(d, safe_serialization=True, max_shard_size='40KB' if name == 'qwen2' else '10GB')
    with open(os.path.join(d, 'tokenizer.json'), 'w') as f:
        json.dump(tokenizer, f, ensure_ascii=False)
    with open(os.path.join(d, 'tokenizer_config.json'), 'w') as f:
        json.dump({'add_bos_token': True, 'bos_token': SPECIAL[0], 'eos_token': SPECIAL[1],
                   'chat_template': "{% for m in messages %}{{ m['content'] }}{% endfor %}"}, f)
    for junk in ('generation_config.json',):
        if os.path.exists(os.path.join(d, junk)):
            os.remove(os.path.join(d, junk))
    with torch.no_grad():
        logits = m(torch.tensor([ids])).logits[0].float()
    name_b = name.encode()
    out += struct.pack('<I', len(name_b)) + name_b
    out += logits.numpy().astype('<f4').tobytes()
    print(name, 'files:', sorted(os.listdir(d)), 'logits', tuple(logits.shape))
with open(os.path.join(OUT, 'logits.bin'), 'wb') as f:
    f.write(bytes(out))

# A real PEFT LoRA adapter on the Llama (get_peft_model + save_pretrained, B made non-zero), and
# the logits of transformers + PEFT with it: `--lora DIR` on the converted model must give them.
from peft import LoraConfig, get_peft_model
torch.manual_seed(7)
base = LlamaForCausalLM.from_pretrained(os.path.join(OUT, 'llama'))
base.eval()
pm = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type='CAUSAL_LM',
                                     target_modules=['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj']))
with torch.no_grad():
    for n_, p in pm.named_parameters():
        if 'lora_' in n_:
            p.normal_(0.0, 0.3)
pm.save_pretrained(os.path.join(OUT, 'llama-peft'))
os.remove(os.path.join(OUT, 'llama-peft', 'README.md'))  # PEFT's model card template
with torch.no_grad():
    lg = pm(torch.tensor([ids])).logits[0].float()
with open(os.path.join(OUT, 'llama-peft-logits.bin'), 'wb') as f:
    f.write(lg.numpy().astype('<f4').tobytes())
print('llama-peft', sorted(os.listdir(os.path.join(OUT, 'llama-peft'))))

# A bitsandbytes 4-bit checkpoint (NF4, double quantisation) of a Llama: every block linear
# quantised by bitsandbytes' own quantize_4bit (its CPU backend, bitsandbytes 0.47.0) and stored
# as transformers stores a Linear4bit (the packed uint8 `weight`, then `weight.<key>` for every
# entry of QuantState.as_dict(packed=True)), with config.json's quantization_config. (transformers
# 4.46 cannot load_in_4bit without a GPU, so the file is assembled the way its serialisation
# writes it rather than by save_pretrained.) The logits are transformers' forward with every
# linear replaced by bitsandbytes' dequantize_4bit of it.
import bitsandbytes.functional as BF
from safetensors.torch import save_file
torch.manual_seed(11)
cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=V, max_position_embeddings=128, rms_norm_eps=1e-5, bos_token_id=BOS, eos_token_id=EOS,
                  rope_theta=10000.0, tie_word_embeddings=False)
m = LlamaForCausalLM(cfg)
m.eval()
sd_extra = {}
with torch.no_grad():
    for n_, p in m.named_parameters():
        p.normal_(1.0, 0.1) if 'norm' in n_ else p.normal_(0.0, 0.2)
    for n_, mod in m.named_modules():
        if isinstance(mod, torch.nn.Linear) and '.layers.' in n_:
            q, st = BF.quantize_4bit(mod.weight.data.contiguous(), blocksize=64, quant_type='nf4', compress_statistics=True)
            mod.weight.data = BF.dequantize_4bit(q, st).to(torch.float32)
            sd_extra[n_ + '.weight'] = q
            for k, v in st.as_dict(packed=True).items():
                sd_extra[n_ + '.weight.' + k] = v
sd = {k: v.contiguous() for k, v in m.state_dict().items()}
sd.update(sd_extra)
d = os.path.join(OUT, 'llama-bnb4')
os.makedirs(d, exist_ok=True)
save_file(sd, os.path.join(d, 'model.safetensors'), metadata={'format': 'pt'})
c = cfg.to_dict()
c['architectures'] = ['LlamaForCausalLM']
c['quantization_config'] = {'quant_method': 'bitsandbytes', 'load_in_4bit': True, 'load_in_8bit': False,
                            'bnb_4bit_quant_type': 'nf4', 'bnb_4bit_use_double_quant': True,
                            'bnb_4bit_compute_dtype': 'float32', 'bnb_4bit_quant_storage': 'uint8'}
with open(os.path.join(d, 'config.json'), 'w') as f:
    json.dump(c, f, indent=2)
with open(os.path.join(d, 'tokenizer.json'), 'w') as f:
    json.dump(tokenizer, f, ensure_ascii=False)
with torch.no_grad():
    lg = m(torch.tensor([ids])).logits[0].float()
with open(os.path.join(OUT, 'llama-bnb4-logits.bin'), 'wb') as f:
    f.write(lg.numpy().astype('<f4').tobytes())
print('llama-bnb4', sorted(os.listdir(d)), len(sd), 'tensors')

# A SentencePiece tokenizer.model trained here by the real sentencepiece 0.2.0 (BPE, whitespace
# kept, as Llama 2's; no byte fallback: the vocabulary is tiny), beside the Mistral's weights:
# `./convert hf` reads the protobuf, and the ids of a few strings must be sentencepiece's own.
import io, shutil
import sentencepiece as spm
text = open('examples/demo.jsonl', encoding='utf-8').read().replace('"', ' ').replace('\\n', ' ')
model = io.BytesIO()
spm.SentencePieceTrainer.train(sentence_iterator=iter(text.split('}')), model_writer=model, vocab_size=V - 8,
                               model_type='bpe', byte_fallback=False, character_coverage=1.0, bos_id=1, eos_id=2,
                               unk_id=0, pad_id=-1, num_threads=1, minloglevel=2, split_digits=True,
                               add_dummy_prefix=True, normalization_rule_name='identity', remove_extra_whitespaces=False)
d = os.path.join(OUT, 'mistral-spm')
os.makedirs(d, exist_ok=True)
shutil.copy(os.path.join(OUT, 'mistral', 'model.safetensors'), os.path.join(d, 'model.safetensors'))
c = json.load(open(os.path.join(OUT, 'mistral', 'config.json')))
c['bos_token_id'], c['eos_token_id'] = 1, 2  # the SentencePiece model's
with open(os.path.join(d, 'config.json'), 'w') as f:
    json.dump(c, f, indent=2)
with open(os.path.join(d, 'tokenizer.model'), 'wb') as f:
    f.write(model.getvalue())
sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
with open(os.path.join(d, 'ids.txt'), 'w', encoding='utf-8') as f:  # "text<TAB>ids" per line
    # (no characters outside the vocabulary: without byte fallback llama.cpp - so qlora - gives an
    # unknown token per unknown byte where sentencepiece gives one per run of unknown characters)
    for s in ['The keeper lights the lamp.', 'Who lights it? One light, one night.', 'A lamp, a ship, a keeper', '  two  spaces']:
        f.write(s + '\t' + ' '.join(str(i) for i in sp.encode(s)) + '\n')
print('mistral-spm', sp.get_piece_size(), 'pieces')
