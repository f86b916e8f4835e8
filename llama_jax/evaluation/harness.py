"""llama-jax as an lm-evaluation-harness model (`pip install -e '.[eval]'`): the `llama-jax` backend.

    import lm_eval
    from llama_jax.evaluation.harness import LlamaJaxLM
    results = lm_eval.simple_evaluate(model=LlamaJaxLM("runs/tiny"), tasks=["hellaswag"], limit=100)

or, once this module is imported, `model="llama-jax", model_args="model=runs/tiny,batch_size=16"`. The model is
any spec the commands take (a run, a checkpoint, hf:DIR, ADAPTER@BASE, an averaged checkpoint) with the
key=value overrides they take (`overrides="mesh.tensor=4 mesh.data=2"`: the model sharded as in training, the
requests' batch over the data axes), or the live parameters of a training run (`LlamaJaxLM.of_params`).

Requests are encoded as lm-eval's `hf` backend encodes them (TemplateLM's context/continuation split, the
tokenizer's own special tokens, the prefix token for an empty context, rolling windows of the model's length),
so the same weights give the same log-likelihoods, metrics and greedy generations; scoring.py batches them by
length. Every process of a multi-process run computes every request (lm-eval sees one rank): the mesh, not
lm-eval, splits the work, and every process gets the same answers.
"""

from __future__ import annotations

import json

import jax
import numpy as np
from lm_eval import utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from llama_jax.checkpoint import specs
from llama_jax.config import ModelConfig, PeftConfig
from llama_jax.data.tokenizer import HFTokenizer, Tokenizer, load_tokenizer
from llama_jax.errors import ConfigError
from llama_jax.evaluation.scoring import Scorer, bucket
from llama_jax.inference.generate import GREEDY, Generator, Sampling, inference_adapters, params_mesh
from llama_jax.model import peft

DEFAULT_BATCH = 16
DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's default for a task that does not say


@register_model("llama-jax", "llama_jax")
class LlamaJaxLM(TemplateLM):
    """lm-eval's LM for a llama-jax model spec (see the module docstring)."""

    def __init__(
        self,
        model: str = "",
        overrides: str | list[str] = (),
        batch_size: int | str = DEFAULT_BATCH,
        dtype: str = "float32",
        tokenizer: str | None = None,
        **_lm_eval_arguments,  # lm-eval passes device= and others that mean nothing here
    ):
        super().__init__()
        if not model:
            raise ConfigError("the llama-jax lm-eval backend needs model=SPEC (a run, a checkpoint or hf:DIR)")
        overrides = overrides.split() if isinstance(overrides, str) else list(overrides)
        spec = specs.resolve(model)
        cfg, params = specs.load_model(spec, dtype, overrides=overrides)
        words = specs.load_tokenizer(spec) if tokenizer is None else load_tokenizer(tokenizer)
        self._setup(cfg, params, words, int(batch_size), None)

    @classmethod
    def of_params(
        cls, cfg: ModelConfig, params, tokenizer: Tokenizer, batch_size: int = DEFAULT_BATCH, rules: tuple | None = None
    ) -> LlamaJaxLM:
        """The backend on parameters already in memory (a training run's, on its mesh under `rules`)."""
        lm = cls.__new__(cls)
        TemplateLM.__init__(lm)
        lm._setup(cfg, params, tokenizer, batch_size, rules)
        return lm

    def _setup(self, cfg: ModelConfig, params, tokenizer: Tokenizer, batch_size: int, rules: tuple | None) -> None:
        self.cfg, self.params, self.words, self.rules = cfg, params, tokenizer, rules
        self.adapters: PeftConfig = inference_adapters(params)
        self.mesh = params_mesh(params)
        self.batch = batch_size
        self.scorer = Scorer(cfg, batch_size, self.mesh, rules, self.adapters)
        self._generators: dict[tuple, Generator] = {}

    # ---- tokens, as the hf backend makes them
    @property
    def eot_token_id(self) -> int:
        return self.words.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.words.eos_id if self.words.bos_id is None else self.words.bos_id

    @property
    def max_length(self) -> int:
        return self.scorer.max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """The tokens of `string`; with special tokens (add_special_tokens None or True) as Hugging Face's
        tokenizer adds them by default: a tokenizer.json's post-processor, or BOS for the others."""
        if add_special_tokens is False:
            return self.words.encode(string)
        if isinstance(self.words, HFTokenizer):
            return self.words.hf.encode(string, add_special_tokens=True).ids
        return ([] if self.words.bos_id is None else [self.words.bos_id]) + self.words.encode(string)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.words.decode(tokens)

    # ---- the three kinds of request
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        answers = self.scorer(self.params, [(context, continuation) for _, context, continuation in requests])
        for (key, _, _), answer in zip(requests, answers):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return answers

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The whole text's log-likelihood, in disjoint windows of the model's length (as the hf backend)."""
        windows, owners = [], []
        for index, (string,) in enumerate(req.args for req in requests):
            rolling = utils.get_rolling_token_windows(
                token_list=self.tok_encode(string),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for context, continuation in map(utils.make_disjoint_window, rolling):
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[owner] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Continuations with the KV cache, cut at the first stop sequence; requests with the same settings
        are batched, longest prompt first."""
        answers: list[str] = [""] * len(requests)
        groups: dict[str, list[int]] = {}
        for index, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(index)
        for members in groups.values():
            kwargs = normalize_gen_kwargs(dict(requests[members[0]].args[1]), DEFAULT_MAX_GEN_TOKS)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=None)
            new_tokens = int(kwargs.pop("max_gen_toks"))
            if new_tokens >= self.max_length:
                raise ConfigError(
                    f"a task asks for {new_tokens} new tokens, but the model holds {self.max_length}; "
                    "set max_gen_toks lower in the task's generation_kwargs"
                )
            sampling = _sampling(kwargs)
            prompts = {i: self.tok_encode(requests[i].args[0])[-(self.max_length - new_tokens) :] for i in members}
            members = sorted(members, key=lambda i: -len(prompts[i]))
            for start in range(0, len(members), self.batch):
                chunk = members[start : start + self.batch]
                texts = self._generate([prompts[i] for i in chunk], new_tokens, sampling, until)
                for i, text in zip(chunk, texts):
                    answers[i] = postprocess_generated_text(text, until, None)
                    self.cache_hook.add_partial("generate_until", requests[i].args, answers[i])
        return answers

    def _generate(self, prompts: list[list[int]], new_tokens: int, sampling: Sampling, until: list[str]) -> list[str]:
        """The decoded continuations of `prompts` (at most `batch`), decoding until each has a stop sequence
        (what follows it is cut by the caller, as the hf backend cuts it) or EOS, or has new_tokens."""
        asked, rows = len(prompts), self.scorer.rows(len(prompts))
        prompts = prompts + [prompts[0]] * (rows - asked)
        prompts = peft.with_prompt_slots(prompts, self.adapters.virtual_tokens)
        cache_len = bucket(max(map(len, prompts)), self.cfg.max_seq_len - new_tokens) + new_tokens
        key = (rows, cache_len, sampling)
        if key not in self._generators:
            self._generators[key] = Generator(self.cfg, rows, cache_len, sampling, self.mesh, self.rules, self.adapters)
        stops = [stop for stop in until if stop]

        def finished(produced):
            return np.array([any(stop in self.words.decode(row) for stop in stops) for row in produced], bool)

        generate = self._generators[key]
        new = generate(
            self.params, prompts, new_tokens, jax.random.key(0), self.words.eos_id, finished if stops else None
        )
        return [self.words.decode(tokens) for tokens in new[:asked]]


def _sampling(kwargs: dict) -> Sampling:
    """Greedy unless the task samples (do_sample with a temperature), as the hf backend decides."""
    if not kwargs.get("do_sample") or not kwargs.get("temperature"):
        return GREEDY
    return Sampling(float(kwargs["temperature"]), int(kwargs.get("top_k") or 0), float(kwargs.get("top_p") or 1.0))
