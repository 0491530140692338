"""Write a tiny random-weight Llama checkpoint directory that real vLLM (CPU) can serve.

Run with the vLLM venv's interpreter (it needs `tokenizers`):
    $SPARK_VLLM_VENV/bin/python sim/spark_sim/tiny_model.py OUT_DIR
Weights are not written: vLLM serves it with `--load-format dummy`. No hub access is needed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB = 1024
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|user|>", "<|assistant|>"]
# A chat template in the plain style vLLM's chat endpoint renders with jinja.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}"
    "{% else %}<|assistant|>{{ m['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def corpus() -> list[str]:
    words = (
        "what are the main differences between tcp and udp write a python function that "
        "implements binary search on a sorted list include type hints and docstring generate "
        "json array of fictional employees with fields name age department salary email skills "
        "output only valid no explanation is show answer complete implementation red black tree "
        "insert delete search in order traversal rotation methods explain step by step how hash "
        "map handles collisions when it resizes"
    ).split()
    lines = []
    for i in range(400):
        lines.append(" ".join(words[(i * 7 + j) % len(words)] for j in range(12)))
    lines.append("".join(chr(c) for c in range(32, 127)))
    return lines


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 16,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": SPECIAL[0],
                "eos_token": SPECIAL[1],
                "pad_token": SPECIAL[1],
                "model_max_length": 4096,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
    )
    (out / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "num_key_value_heads": 2,
                "head_dim": 32,  # CPU attention accepts 32, 64, 80, ...
                "vocab_size": VOCAB,
                "max_position_embeddings": 4096,
                "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0,
                "hidden_act": "silu",
                "tie_word_embeddings": False,
                "bos_token_id": tok.token_to_id(SPECIAL[0]),
                "eos_token_id": tok.token_to_id(SPECIAL[1]),
                "torch_dtype": "bfloat16",
            },
            indent=2,
        )
    )
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": tok.token_to_id(SPECIAL[0]), "eos_token_id": tok.token_to_id(SPECIAL[1])})
    )


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: tiny_model.py OUT_DIR")
    main(Path(sys.argv[1]))
