"""The training steps' fixture: python benchmarks/gpu/fixture.py WORK writes, in WORK, the tiny
random Llama + character tokenizer (tests/support/tiny_models.py) as model/ (and one with head_dim 32,
which vLLM's attention runs, as model_vllm/ for the vllm step), a reward file reward.py
(``reward``) and prompts.jsonl (16 prompts), which gpu_check.sh's train / lora / fsdp steps pass to
pyppo train. gpu_check.sh runs it once, before those steps; a non-zero exit fails all three."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from support.tiny_models import save_tiny_causal_lm

work = Path(sys.argv[1])
save_tiny_causal_lm(work / "model")
# The vllm step's model: head_dim 32, a size vLLM's attention kernels run (the tiny model's is 8).
from transformers import LlamaForCausalLM  # noqa: E402

from support.tiny_models import tiny_llama_config, tiny_tokenizer  # noqa: E402

LlamaForCausalLM(tiny_llama_config(hidden_size=64, num_attention_heads=2, num_key_value_heads=1)).save_pretrained(
    work / "model_vllm"
)
tiny_tokenizer().save_pretrained(work / "model_vllm")
(work / "reward.py").write_text(
    "def reward(prompts, responses):\n    return [r.count('e') - 0.1 * len(r) for r in responses]\n"
)
topics = ["the sea", "a tree", "the weather", "breakfast", "a letter", "the street", "evening", "a melody"]
with open(work / "prompts.jsonl", "w") as f:
    for t in topics:
        f.write(json.dumps({"prompt": f"Tell me about {t}."}) + "\n")
        f.write(json.dumps({"prompt": f"Describe {t} in one line."}) + "\n")
print("gpu_check: fixture in", work)
