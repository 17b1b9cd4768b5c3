"""Reward models and weighted reward mixes.

**A reward model** (``reward_model.path``): a Hugging Face ``AutoModelForSequenceClassification``
with one output (a Bradley-Terry scalar head, the shape of the Skywork-Reward-V2 family), run in
a process of its own (:class:`RewardModelWorker`: loaded once per run, on the CPU or a device of
its own, ``reward_model.device``) and scored in batches of ``reward_model.batch_size``. Each
response is scored as the conversation ``[prompt messages..., {"role": "assistant", "content":
response}]`` through the reward model's *own* chat template (its tokenizer's), truncated to
``reward_model.max_length`` tokens from the left (the response end is kept); the score is the
head's output at the last token (Hugging Face's pooling).

**A mix** (``reward.fns``): ``{name: weight}``, each name a registered reward, a dotted
``module:function``, or ``reward_model``; the reward is ``sum_k w_k r_k`` (:class:`RewardMix`),
each component scored as alone (a verifier's errors and timeouts score 0 and are counted), and
each component's mean is logged (``reward/component/{name}``).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Sequence

from gspo_megatron.rewards.workers import WorkerPool, serve

logger = logging.getLogger(__name__)

__all__ = ["REWARD_MODEL", "RewardMix", "RewardModelScorer", "RewardModelWorker"]

REWARD_MODEL = "reward_model"
"""The name of the reward model in ``reward.fns``."""


def conversation(prompt: Any, response: str) -> list[dict[str, str]]:
    """``prompt`` (a string or chat messages) + the response as the assistant's message."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    return messages + [{"role": "assistant", "content": response}]


class RewardModelScorer:
    """A loaded reward model: ``score(prompts, responses) -> list[float]`` (module docstring)."""

    def __init__(self, path: str, batch_size: int = 16, max_length: int = 4096,
                 device: str = "cpu") -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.padding_side = "right"
        self.tokenizer.truncation_side = "left"
        self.model = AutoModelForSequenceClassification.from_pretrained(path).to(device).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(f"reward_model.path={path!r}: a reward model has one output "
                             f"(num_labels 1), this one has {self.model.config.num_labels}")
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.batch_size, self.max_length, self.device = int(batch_size), int(max_length), device
        self._torch = torch

    def texts(self, prompts: Sequence[Any], responses: Sequence[str]) -> list[str]:
        """The text each response is scored as: the reward model's chat template over the
        conversation (no generation prompt)."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            return [(p if isinstance(p, str) else "\n".join(m["content"] for m in p)) + r
                    for p, r in zip(prompts, responses)]
        return [self.tokenizer.apply_chat_template(conversation(p, r), tokenize=False)
                for p, r in zip(prompts, responses)]

    def score(self, prompts: Sequence[Any], responses: Sequence[str]) -> list[float]:
        """One float per response, in order."""
        texts, out = self.texts(prompts, responses), []
        with self._torch.inference_mode():
            for lo in range(0, len(texts), self.batch_size):
                enc = self.tokenizer(texts[lo:lo + self.batch_size], return_tensors="pt",
                                     padding=True, truncation=True, max_length=self.max_length,
                                     add_special_tokens=False).to(self.device)
                out += self.model(**enc).logits[:, 0].float().tolist()
        return out

    def score_or_error(self, prompts: Sequence[Any], responses: Sequence[str]
                       ) -> tuple[list[float] | None, str | None]:
        """``(scores, None)``, or ``(None, why)`` when scoring raised."""
        try:
            return self.score(prompts, responses), None
        except Exception as e:  # noqa: BLE001 - the mix scores the component 0
            return None, f"{type(e).__name__}: {e}"


def _worker_main(conn, spec: str, search_dirs: Sequence[str],
                 parent_pid: int) -> None:  # pragma: no cover - child
    """Load the reward model named by ``spec`` (JSON of :class:`RewardModelScorer`'s arguments),
    then score batches until told to stop."""
    messages = serve(conn, parent_pid, lambda: RewardModelScorer(**json.loads(spec)))
    scorer = next(messages, None)
    for _, index, (prompts, responses) in messages:
        conn.send(("done", index, *scorer.score_or_error(prompts, responses)))


class RewardModelWorker(WorkerPool):
    """The reward model in a process of its own. ``score_or_error`` returns ``(scores, error)``:
    the scores, or None and why (an exception, or no answer within ``timeout_s``: the worker is
    then replaced, the model loaded again)."""

    what = "reward model worker"
    _target = staticmethod(_worker_main)

    def __init__(self, path: str, batch_size: int, max_length: int, device: str,
                 timeout_s: float) -> None:
        spec = json.dumps({"path": path, "batch_size": batch_size, "max_length": max_length,
                           "device": device})
        super().__init__(spec, 1, timeout_s)

    def score_or_error(self, prompts: Sequence[Any], responses: Sequence[str]
                       ) -> tuple[list[float] | None, str | None]:
        self.start()
        w = self._workers[0]
        w.conn.send(("call", 0, (list(prompts), list(responses))))
        w.call = (0, time.monotonic() + self.timeout_s)
        ready, _ = self._wait()
        w.call = None
        if w.conn not in ready:
            self._workers[0].kill()
            self._workers[0] = self._spawn()
            return None, f"no answer within reward_model.timeout_s={self.timeout_s:g} s"
        try:
            _, _, scores, error = w.conn.recv()
        except EOFError:
            self._workers[0] = self._spawn()
            return None, "the reward model's process died"
        return scores, error


class RewardMix:
    """``sum_k w_k r_k`` over ``components`` ``[(name, fn or None, weight)]`` (None: the reward
    model, ``scorer``: a :class:`RewardModelWorker` or a :class:`RewardModelScorer`). Called as a
    reward function it scores one response (the verifiers only: the trainer scores batches with
    :meth:`score_batch`)."""

    def __init__(self, components: list[tuple[str, Any, float]], scorer=None) -> None:
        self.components, self.scorer = components, scorer
        self.__name__ = "+".join(f"{w:g}*{name}" for name, _, w in components)

    def __call__(self, response, answer, example=None) -> float:
        if self.scorer is not None:
            raise RuntimeError("a reward mix with a reward model scores batches (score_batch)")
        return sum(w * float(fn(response, answer, example)) for _, fn, w in self.components)

    def score_batch(self, responses: Sequence[str], answers: Sequence[str],
                    examples: Sequence[Any], timeout_s: float, correct_threshold: float = 1.0):
        """``(rewards [N] float32, stats)``: the weighted sum and ``reward/*`` (the
        components' errors, timeouts and invalid values added up; ``reward/accuracy`` counts
        the first verifier's correct answers, the reward model's scores having no threshold),
        with ``reward/component/{name}`` (each component's mean)."""
        import torch

        from gspo_megatron.rewards.registry import compute_rewards, is_correct

        total = torch.zeros(len(responses), dtype=torch.float64)
        verified = None  # the first verifier's rewards: what reward/accuracy counts
        stats: dict[str, float] = {"reward/errors": 0.0, "reward/timeouts": 0.0,
                                   "reward/invalid": 0.0, "reward/hung_threads": 0.0}
        for name, fn, weight in self.components:
            if fn is None:
                scores, error = self.scorer.score_or_error([e.model_input for e in examples],
                                                           responses)
                if scores is None:
                    logger.warning("reward model: %s; its component scores 0", error)
                    stats["reward/errors"] += len(responses)
                    scores = [0.0] * len(responses)
                values = torch.tensor(scores, dtype=torch.float64)
            else:
                values, part = compute_rewards(fn, responses, answers, examples, timeout_s=timeout_s)
                values = values.double()
                for k in ("reward/errors", "reward/timeouts", "reward/invalid"):
                    stats[k] += part[k]
                stats["reward/hung_threads"] = part["reward/hung_threads"]
            if fn is not None and verified is None:
                verified = values
            stats[f"reward/component/{name}"] = float(values.mean()) if len(values) else 0.0
            total += weight * values
        rewards = total.float()
        n = len(responses)
        verified = rewards if verified is None else verified
        stats.update({"reward/mean": float(rewards.mean()) if n else 0.0,
                      "reward/std": float(rewards.std(unbiased=False)) if n else 0.0,
                      "reward/accuracy": (sum(is_correct(float(r), correct_threshold)
                                              for r in verified) / n) if n else 0.0})
        return rewards, stats

    def close(self) -> None:
        if isinstance(self.scorer, RewardModelWorker):
            self.scorer.close()
