"""Speculative decoding with the checkpoint's own multi-token prediction (MTP) module: draft ``k`` tokens, verify
them in one step of the trunk, keep the longest prefix the trunk agrees with, roll the rest back.

One round for a sequence whose cache holds ``L`` tokens and whose next token ``x`` is known (not yet run)::

    drafts d1..dk               the MTP module, one token after another (its own keys and values, its own hidden)
    verify [x, d1, .., dk]      one unrolled step of the trunk: each token as its own decode step would run it
    accept a                    the longest prefix with d(i+1) == argmax(logits after token i)
    emit d1..da, y              y = the trunk's own token after the last accepted one (a draft's correction, or a
                                bonus token when all k were right)
    roll back                   the cache keeps x, d1..da (the Gated DeltaNet states saved after each token)
    MTP catch-up                the MTP module reruns positions L..L+a on the trunk's hidden states, then drafts

Every emitted token is the token the trunk picks after exactly the tokens before it, computed as a plain decode
step computes it: the argmax, or for a sampled request the same Gumbel-max draw plain sampling makes (its noise is a
function of the request's seed, the token's index and the token id: :mod:`lynn_model.sampling`). So the output
equals plain decoding's, greedy or seeded, token for token, wherever the kernels give a row the same bits whatever
the number of rows beside it (docs/decoder.md, "Speculative decoding"). The drafts use the same noise, so a draft
from a module that agrees with the trunk is accepted under sampling too.
"""

from __future__ import annotations

from typing import Callable

import torch

from .cache import Cache
from .model import Model
from .sampling import Sampling, SamplingParams, sample_rows


class Picker:
    """The token plain decoding picks from ``logits [R, vocab]`` whose rows predict the tokens of index
    ``counter[r]`` in their sequences: the argmax (greedy, ties to the lowest id) or the request's seeded draw."""

    def __init__(self, setting: Sampling | None, device, vocab: int):
        self.setting, self.device, self.vocab = setting, torch.device(device), vocab
        self._params: dict[int, SamplingParams] = {}

    def __call__(self, logits: torch.Tensor, counter: list[int]) -> torch.Tensor:
        if self.setting is None or self.setting.greedy:
            return logits.float().argmax(-1)
        rows = logits.shape[0]
        if rows not in self._params:
            self._params[rows] = SamplingParams.build([self.setting] * rows, self.device, self.vocab)
        return sample_rows(logits, self._params[rows], torch.tensor(counter, dtype=torch.int64, device=self.device))


class MTPDrafter:
    """Drafts with the model's MTP module, keeping its keys and values in the trunk's cache; each draft is the
    token ``pick`` makes from the module's logits (the trunk's own rule, so under sampling the same noise)."""

    def __init__(self, model: Model, k: int, pick: Picker):
        if model.mtp is None:
            raise ValueError(f"{model.config.name or model.config.family}: this model has no MTP module (its "
                             f"checkpoint holds no mtp.* tensors); run without --mtp")
        self.model, self.k, self.pick = model, k, pick

    def start(self, cache: Cache, slots: list[int], prompts: list[list[int]], hidden: torch.Tensor,
              first: list[int]) -> list[list[int]]:
        """After the prompts' prefill (``hidden``: the trunk's rows of every prompt token, packed): run the MTP
        layer over every prompt position and draft ``k`` tokens after ``first``."""
        nxt = [t for p, f in zip(prompts, first) for t in [*p[1:], f]]
        return self._draft(cache, slots, nxt, hidden, [len(p) for p in prompts], [0] * len(slots))

    def advance(self, cache: Cache, slots: list[int], accepted: list[list[int]], hidden: list[torch.Tensor],
                starts: list[int]) -> list[list[int]]:
        """After a verify: ``accepted[b]`` the tokens after each kept position of sequence ``slots[b]`` (its
        accepted drafts and the trunk's next token), ``hidden[b]`` the trunk's rows at those positions, from
        ``starts[b]``; the MTP layer reruns them (its rows there came from drafts) and drafts ``k`` more."""
        nxt = [t for a in accepted for t in a]
        return self._draft(cache, slots, nxt, torch.cat(hidden), [len(a) for a in accepted], starts)

    def _draft(self, cache, slots, nxt: list[int], hidden, lens: list[int], starts: list[int]) -> list[list[int]]:
        m, dev = self.model, self.model.device
        logits, h = m.mtp_step(torch.tensor(nxt, dtype=torch.long, device=dev), hidden, cache, slots, lens, starts)
        ends = torch.tensor(lens, device=dev).cumsum(0) - 1
        pos = [s + n for s, n in zip(starts, lens)]           # the next position; its token has index pos + 1
        tok, h = self.pick(logits, [p + 1 for p in pos]), h[ends]
        drafts = [tok]
        for _ in range(self.k - 1):           # each draft after a draft: its own hidden state, one position on
            logits, h = m.mtp_step(tok, h, cache, slots, [1] * len(slots), pos)
            pos = [p + 1 for p in pos]
            tok = self.pick(logits, [p + 1 for p in pos])
            drafts.append(tok)
        return torch.stack(drafts, 1).tolist()


def speculative_decode(model: Model, cache: Cache, slots: list[int], out: list[list[int]], first: list[int],
                       hidden: torch.Tensor, k: int, budget: int, stops: set, emit: Callable, stats,
                       setting: Sampling | None = None, drafter=None, check_finite: Callable | None = None) -> None:
    """Continue sequences ``slots`` (``out[b]``: prompt and first token; ``hidden``: the prefill's rows) by
    speculative rounds until each stops or has ``budget`` more tokens. ``emit(b, token)`` takes each new token in
    order and returns whether sequence ``b`` goes on. ``setting``: the requests' sampling (None: greedy).
    ``drafter``: :class:`MTPDrafter` by default (tests pass one that proposes chosen tokens). ``check_finite(live,
    flags)`` sees, before a round emits anything, whether the logits of each live sequence's rows it would emit from
    are finite (1) or not (0), and may raise."""
    dev = model.device
    pick = Picker(setting, dev, model.config.vocab_size)
    drafter = drafter or MTPDrafter(model, k, pick)
    live = list(range(len(slots)))
    prompts = [o[:-1] for o in out]
    drafts = drafter.start(cache, slots, prompts, hidden, first)
    pending, left = list(first), [budget] * len(slots)
    while live:
        run = [slots[b] for b in live]
        starts = [cache.lengths[s] for s in run]
        tokens = torch.tensor([t for b in live for t in [pending[b], *drafts[b]]], dtype=torch.long, device=dev)
        logits, h = model.step(tokens, cache, run, [k + 1] * len(run), all_logits=True, unroll=True, hidden=True)
        counter = [p + j + 1 for p in starts for j in range(k + 1)]     # row j predicts the token of index L + j + 1
        # one host read: the picks and, as plain decoding checks them, whether each row's logits are finite
        want, finite = torch.stack([pick(logits, counter), torch.isfinite(logits.amax(-1)).long()]).view(
            2, len(run), k + 1).tolist()
        h = h.view(len(run), k + 1, -1)
        took = []
        for i, b in enumerate(live):
            a = 0
            while a < k and drafts[b][a] == want[i][a]:
                a += 1
            took.append(a)
        if check_finite is not None:
            check_finite(live, [int(all(finite[i][:a + 1])) for i, a in enumerate(took)])
        keep, accepted, rows, still = [], [], [], []
        for i, (b, a) in enumerate(zip(live, took)):
            stats.drafted += k
            stats.accepted += a
            new = [*drafts[b][:a], want[i][a]]
            going = True
            for t in new[:left[b]]:
                going = emit(b, t)
                left[b] -= 1
                if not going:
                    break
            going = going and left[b] > 0
            keep.append(a + 1)
            if going:
                still.append(b)
                accepted.append(new)
                rows.append(h[i, :a + 1])
                pending[b] = new[-1]
        stats.verify_steps += 1
        cache.rollback(run, keep)
        start_of = dict(zip(live, starts))
        live = still
        if live:
            new_drafts = drafter.advance(cache, [slots[b] for b in live], accepted, rows, [start_of[b] for b in live])
            for b, d in zip(live, new_drafts):
                drafts[b] = d


__all__ = ["MTPDrafter", "Picker", "speculative_decode"]
