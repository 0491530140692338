"""Stand-in of vllm/model_executor/layers/logits_processor.py."""


class LogitsProcessor:
    def __init__(self, vocab_size, scale=1.0):
        self.vocab_size = vocab_size
        self.scale = scale

    def forward(self, lm_head, hidden_states):
        return lm_head(hidden_states) * self.scale
