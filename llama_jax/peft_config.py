"""The `peft.*` section of the schema: parameter-efficient tuning of a trained model, and its checks.

    none     full training: every parameter learns (the default)
    lora     W x + (alpha / rank) · B(A(x)) in the projections named by `targets`: A [in, rank] and
             B [rank, out] learn, B starts at zero so step 0 is the base model exactly (Hu et al. 2021)
    prompt   `prompt_tokens` learned embeddings in front of every document (Lester et al. 2021)
    ptuning  the same virtual tokens, made by a small prompt encoder (an MLP or a bidirectional LSTM,
             Liu et al. 2021) that is dropped after training: only its output is exported

Every method adapts the model of checkpoint.init_from, which stays frozen; peft.py holds the mechanics.
Kept apart from config.py (which imports it) so the schema module stays short; like config.py it
imports nothing of llama_jax but errors.py and vocabulary.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llama_jax.errors import ConfigError
from llama_jax.vocabulary import LORA_TARGETS, PEFT_METHODS, PROMPT_ENCODERS


@dataclass(frozen=True)
class PeftConfig:
    method: str = "none"  # none | lora | prompt | ptuning
    rank: int = 8  # lora: rank of the update
    alpha: float = 16.0  # lora: the update is scaled by alpha / rank
    targets: list[str] = field(default_factory=lambda: ["q", "v"])  # lora: any of q, k, v, o, gate, up, down
    dropout: float = 0.0  # lora: dropout on the adapters' input while training
    prompt_tokens: int = 20  # prompt, ptuning: virtual tokens in front of every document
    prompt_encoder: str = "mlp"  # ptuning: mlp | lstm
    encoder_hidden: int = 0  # ptuning: the encoder's width (0: model.d_model)

    @property
    def virtual_tokens(self) -> int:
        """Slots in front of every document that the model fills with learned embeddings (0: none)."""
        return self.prompt_tokens if self.method in ("prompt", "ptuning") else 0

    def lora_rank(self, target: str) -> int:
        """The rank of the adapter on one projection (q, k, ... down), 0 where there is none."""
        return self.rank if self.method == "lora" and target in self.targets else 0


def check_peft(peft: PeftConfig, seq_len: int, init_from: str, resume_from: str) -> None:
    """One ConfigError line for the first bad peft.* value; a method's own keys are checked only when
    it is chosen (a prompt length never refuses a LoRA run)."""
    def require(ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(message)

    require(peft.method in PEFT_METHODS, f"peft.method must be one of {', '.join(PEFT_METHODS)}, got '{peft.method}'")
    if peft.method == "none":
        return
    require(bool(init_from), f"peft.method={peft.method} adapts a trained model: set checkpoint.init_from to its run "
                             "directory, checkpoint or hf:DIR")
    require(not resume_from, "checkpoint.resume_from does not apply to peft runs; re-run the same command on the "
                             "same run.dir to resume (checkpoint.init_from names the base model)")
    if peft.method == "lora":
        unknown = [t for t in peft.targets if t not in LORA_TARGETS]
        require(not unknown, f"peft.targets: unknown target '{unknown[0] if unknown else ''}'; "
                             f"choose from {', '.join(LORA_TARGETS)}")
        require(len(peft.targets) > 0 and len(set(peft.targets)) == len(peft.targets),
                f"peft.targets must name each projection at most once, and at least one, got {peft.targets}")
        require(peft.rank > 0, f"peft.rank must be positive, got {peft.rank}")
        require(peft.alpha > 0, f"peft.alpha must be positive, got {peft.alpha}")
        require(0 <= peft.dropout < 1, f"peft.dropout must be in [0, 1), got {peft.dropout}")
        return
    require(0 < peft.prompt_tokens < seq_len,
            f"peft.prompt_tokens ({peft.prompt_tokens}) must be positive and leave room for text in train.seq_len "
            f"({seq_len}); lower peft.prompt_tokens or raise train.seq_len")
    require(peft.prompt_encoder in PROMPT_ENCODERS,
            f"peft.prompt_encoder must be one of {', '.join(PROMPT_ENCODERS)}, got '{peft.prompt_encoder}'")
    require(peft.encoder_hidden >= 0, f"peft.encoder_hidden must be >= 0 (0: model.d_model), got {peft.encoder_hidden}")
