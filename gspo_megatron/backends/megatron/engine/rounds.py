"""Multi-step decoding over Megatron's dynamic context: ``K`` decoding steps per host round trip.

Megatron's dynamic engine does its bookkeeping on the host after every step (``update_requests``:
which requests finished, who needs a KV block, the next step's token tables; the attention
metadata), each a wait for the device. Once every running request is decoding (nothing waiting
for a slot, nothing paused), the next ``K`` steps need none of it:

1. **One read** at the start of a round (``[3, n]`` values: each request's cached length, block
   count and tokens left): the blocks each request needs for ``K``
   more tokens are taken from Megatron's block allocator and written into its block table, and
   the round's key window ``Lk`` (the longest request's length after ``K`` steps) is fixed.
2. ``K`` steps of :func:`~..kernels.decode.decode_forward` with the round's static shapes: a
   token sampled per request (the controller's sampling function), its log-prob, the finish test
   (Megatron's rule: its termination id, or prompt + budget tokens) kept on the device; a request
   that finished keeps running to the round's end on its own blocks, its tokens ignored.
3. **One read** at the end (which request was live at which step): the live steps' tokens and
   log-probs join the call, finished requests are reported step by step (a partial rollout's
   ``GroupStop`` takes effect at the round's end, its later steps kept), and Megatron's tables
   are written back as if its own
   engine had run those steps, ending in its own ``update_requests`` (finished requests leave,
   their blocks freed; a request needing a block is paused or evicted as before).

``K`` is at most ``rollout.decode_steps_per_sync``, cut to the most tokens any request can still
write, and follows how fast requests end (:func:`round_length`: the rows a round computes past
their request's end against the round's own cost). Host reads per step: ``(2 + update_requests'
~4) / K``, against ~9 per step before.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from gspo_megatron.backends.megatron.kernels.decode import (DecodeBatch, DecodeWeights,
                                                            KeyGroup, decode_forward,
                                                            moe_only_step)
from gspo_megatron.backends.megatron.engine.decode_weights import WeightsProvider
from gspo_megatron.backends.megatron.engine.megatron_kv import MegatronKV
from gspo_megatron.backends.megatron.kernels import batch_invariant as bi
from gspo_megatron.rollouts import kv_fp8

ROUND_COST_ROWS = 64
"""The default of ``rollout.decode_round_cost_rows``: a round's own cost (two host reads, the plan, the write-back and Megatron's
``update_requests``: ~0.44 ms on CPU) in decoding row-steps (~0.008 ms a row and step on the tiny
model at 90-120 rows): what :func:`round_length` weighs against the rows a round computes past
their end."""


def round_length(most: int, rows: int, finish_rate: float | None,
                 cost_rows: int = ROUND_COST_ROWS) -> int:
    """Steps of the next decoding round of ``rows`` requests, at most ``most``
    (``rollout.decode_steps_per_sync``). A request that ends inside a round is computed on,
    masked, to the round's end: with requests ending at a rate ``p`` per live row-step, a round of
    ``K`` steps computes about ``rows p K^2 / 2`` such rows, against its own cost ``R``
    (``cost_rows``: ``rollout.decode_round_cost_rows``) shared by its ``K`` steps; ``K = sqrt(2 R / (rows p))`` makes their
    sum per step least. ``finish_rate``: ``p`` as the steps just before saw it (the previous
    round, or the engine's own step before it: a call's prefill, where the requests whose first
    token ended them tell the rate); 0 (none ended): ``most``; None (nothing seen yet: a call
    that starts with held requests): half of ``most``. Never below a quarter of ``most`` (the
    host reads per step stay <= 8 / ``most``). On the long-tail benchmark's tail
    (ends at 1/24 a token, 128 requests) the rounds go 5, 6, 7, 8, 12, ..., 16 steps as the
    batch thins out, where a fixed 16 computed ~24 % of the early rounds' rows past their end;
    a batch whose requests do not end takes whole rounds from the first."""
    if finish_rate is None:
        return max(1, most // 2)
    if finish_rate <= 0:
        return most
    best = math.sqrt(2 * cost_rows / (max(rows, 1) * finish_rate))
    return max(max(1, most // 4), min(most, round(best)))


class FastDecoder:
    """Rounds of :func:`~..kernels.decode.decode_forward` over ``context`` (Megatron's dynamic
    context, its KV buffer and tables), for the model ``runner_model`` (the ``GPTModel`` whose
    weights sample: the policy, or the bf16 copy inside its ``Float16Module``)."""

    def __init__(self, runner_model, context, controller, wrapper, steps_per_sync: int,
                 cuda_graphs: bool = False, experts: str = "auto", coupled=None,
                 round_cost_rows: int = ROUND_COST_ROWS):
        self.model = runner_model
        self.provider = WeightsProvider(runner_model, wrapper.real_vocab_size, experts, coupled)
        """The weights of each call and their lifetime (stacks, replicas: :mod:`.decode_weights`)."""
        self.context = context
        self.kv = MegatronKV(context)
        """Megatron's tables, blocks and buffer as a round reads and writes them (its layout
        checked: :class:`~.megatron_kv.LayoutError` otherwise)."""
        self.controller = controller
        self.wrapper = wrapper
        self.steps_per_sync = int(steps_per_sync)
        self.round_cost_rows = int(round_cost_rows)
        """``rollout.decode_round_cost_rows``: a round's own cost in row-steps."""
        self.weights: DecodeWeights | None = None
        self._rotary: tuple[int, torch.Tensor, torch.Tensor] | None = None
        self._finish_rate: float | None = None
        """Requests ended per live row-step in this call's last round, or in the engine's own
        step before it (:meth:`observe`): what :func:`round_length` sizes the next round by."""
        self._finite: dict[int, int] = {}
        """Request id -> slots of its first KV block known to hold finite values (written by a
        step, or zeroed by a round): a round zeroes only the slots past that which it reads."""
        self.step_fn = decode_forward
        """The step: :func:`~..kernels.decode.decode_forward`, or its CUDA graphs."""
        self.graphs = None
        self.kv_error: list[torch.Tensor] | None = (
            [] if getattr(context, "params_dtype", None) == kv_fp8.STORAGE else None)
        """With an FP8 KV cache: this call's prefills' ``[2]`` error sums, per layer and step
        (:meth:`kv_metrics`); None: a cache in the compute dtype."""
        buffer = getattr(context, "memory_buffer", None)
        if cuda_graphs and buffer is not None and buffer.is_cuda:
            from gspo_megatron.backends.megatron.kernels.graphs import GraphedDecode

            alloc = context.block_allocator
            self.graphs = GraphedDecode(alloc.dummy_block_idx * context.block_size_tokens,
                                        context.block_size_tokens)

    @property
    def replicated(self) -> bool:
        """Whether the current (or last) call gathered every EP rank's experts here."""
        return self.provider.replicated

    def buffer_allocated(self) -> None:
        """The KV buffer was allocated anew (``torch.empty``): zero Megatron's dummy block,
        whose first slot stands in for the keys past a round's window (masked keys must be
        finite: a NaN key or value poisons a softmax row even under the mask)."""
        ctx = self.context
        ctx.memory_buffer[:, :, ctx.block_allocator.dummy_block_idx] = 0

    def begin(self) -> None:
        """Read the weights for one ``generate`` (:class:`~.decode_weights.WeightsProvider`:
        the experts stacked for its duration, under EP gathered from every rank when
        ``rollout.decode_experts`` says so); under CUDA graphs, the buckets the last call met
        captured now, largest first, not inside a round. Collective over the coupled group."""
        # (a new buffer, or held requests: their slots past their keys are zeroed again once)
        self._finite.clear()
        self._finish_rate = None
        if self.kv_error is not None:
            self.kv_error.clear()
        self.weights = self.provider.acquire()
        if self.graphs is not None and self.weights.ep_group is None:
            self.step_fn = self.graphs
            cos, sin = self._cos_sin(self.weights.embedding.dtype)
            self.graphs.prepare(self.weights, self.context.memory_buffer, cos, sin)
        else:  # (EP: the gathers' shapes change every round; eager)
            self.step_fn = decode_forward

    def end(self) -> None:
        """The call ended: its weights (stacks, replicas) let go, and the graphs and their pool
        with them (they read the call's stacks; even when the engine holds requests and their
        KV cache for the next call, nothing else of this one is kept)."""
        self.weights = None
        self.provider.release()
        if self.graphs is not None:
            self.graphs.release()

    def release(self) -> None:
        """The rollout phase ended (the engine's ``suspend()``): the rotary table let go too;
        nothing of the decoder outlives the rollout."""
        self.end()
        self._rotary = None
        self._finite.clear()

    def metrics(self) -> dict[str, float]:
        """``rollout/decode_graphs`` and ``rollout/decode_graph_captures`` under CUDA graphs
        (:meth:`~..kernels.graphs.GraphedDecode.metrics`), else ``rollout/decode_graphs`` 0."""
        if self.graphs is None:
            return {"rollout/decode_graphs": 0.0}
        return self.graphs.metrics()

    def kv_metrics(self) -> dict[str, float]:
        """``rollout/kv_fp8_rel_err``: ``||K - Q s|| / ||K||`` over the keys and values the last
        call's prefills wrote into the FP8 cache (every layer; measured on the prefills only,
        which write most of a rollout's keys, so the decoding rounds pay nothing). One host
        read; empty when there is nothing to report."""
        if not self.kv_error:
            return {}
        err, norm = torch.stack(self.kv_error).sum(dim=0).tolist()
        return {"rollout/kv_fp8_rel_err": (err / norm) ** 0.5 if norm > 0 else 0.0}

    def evicted(self, request_ids: list[int]) -> None:
        """Requests Megatron evicted (their blocks freed; each comes back under its id with
        new blocks): what was known of their slots no longer holds."""
        for request_id in request_ids:
            self._finite.pop(request_id, None)

    @property
    def independent(self) -> bool:
        """Whether this call's steps need no other rank (EP = 1, or the experts replicated): the
        ranks then need no lock-step, and prefills run the step function too."""
        return self.weights.ep_group is None

    def observe(self, ended: int) -> None:
        """A step outside the rounds (the engine's own: a prefill, admissions) just ended
        ``ended`` of the requests it forwarded (those still running, and they): the rate the
        next round's length starts from (:func:`round_length`)."""
        ctx = self.context
        rows = ended + ctx.total_request_count - ctx.paused_request_count
        if rows > 0:
            self._finish_rate = ended / rows

    def ready(self, call) -> bool:
        """Whether the next steps are decode-only: nothing waiting, nothing paused, and every
        request past its prefill."""
        ctx = self.context
        return (not call.waiting and ctx.paused_request_count == 0
                and ctx.total_request_count > 0 and ctx.num_prefill_requests == 0
                and ctx.chunked_prefill_request_id == -1)

    def _cos_sin(self, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary table ``[S, 1, 1, rot]`` of the context's longest sequence (cos, sin)."""
        from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
            _yarn_get_concentration_factor_from_config as concentration)

        from gspo_megatron.backends.megatron.kernels.rotary import cos_sin

        key = (self.context.max_sequence_length, dtype)
        if self._rotary is None or self._rotary[0] != key:
            rope = self.model.rotary_pos_emb
            freqs = rope(self.context.max_sequence_length)
            if isinstance(freqs, tuple):  # YaRN: (freqs, mscale)
                freqs = freqs[0]
            pair = cos_sin(freqs, concentration(self.model.config), dtype)
            self._rotary = (key, pair.cos, pair.sin)
        return self._rotary[1], self._rotary[2]

    def plan(self, early_stop: bool = False) -> "Plan":
        """The round-start read (one host read): each running request's cached tokens, blocks
        held and tokens left; the steps this rank wants and the blocks they need.
        ``early_stop``: a partial rollout refills its requests as others end, and the new
        prompts wait for the round's end (a mixed step prefills them, :meth:`mixed_logits`),
        and its stop lands at the round's end: rounds of a quarter of the steps then (4 of 16:
        1.26x long-tailed / uniform per real token on the long-tail benchmark's partial pool
        with kept KV, against 1.39x at 16 steps, where the refills wait too long, and 1.34x at
        2, where each round's bookkeeping is shared by two steps)."""
        first, n = self.kv.running()
        pos0, counts, room, ids = self.kv.read_plan()
        longest = (max(1, self.steps_per_sync // 4) if early_stop else
                   round_length(self.steps_per_sync, n, self._finish_rate,
                                self.round_cost_rows))
        steps = max(1, min(longest, max(room)))
        need = self.kv.blocks_needed(pos0, counts, steps)
        return Plan(first, n, pos0, counts, need, steps, self.kv.has_blocks(sum(need)), ids)

    def mixed_logits(self, recorder=None) -> torch.Tensor:
        """``[n, V]`` fp32, divided by the sampling temperature: the logits of each request's
        last token in the step Megatron's context has laid out (``initialize_attention_state``
        done: prompts being prefilled beside one token per decoding request), by
        :func:`~..kernels.decode.decode_forward` instead of Megatron's forward (its module tree,
        its MoE dispatcher's host reads). One host read (each request's new and cached tokens);
        the keys and values land where Megatron's forward puts them; R3: every token's routes to
        ``recorder``. Only when no other rank's step waits on this one (:attr:`independent`)."""
        ctx, w = self.context, self.weights
        first, last = ctx.paused_request_count, ctx.total_request_count
        device, bs = ctx.request_ids.device, ctx.block_size_tokens
        T = int(ctx.active_token_count)
        q_len, cached = torch.stack((ctx.request_query_lengths[first:last],
                                     ctx.request_kv_length_offsets[first:last])).tolist()
        starts = [0]
        for q in q_len:
            starts.append(starts[-1] + q)
        tokens = ctx.token_to_input_ids[:T].long()
        positions = ctx.token_to_pos_ids[:T].long()
        slots = (ctx.token_to_block_idx[:T].long() * bs
                 + ctx.token_to_local_position_within_kv_block[:T].long())
        table = ctx.request_to_kv_block_ids[first:last].long()
        scratch = ctx.block_allocator.dummy_block_idx * bs
        groups = []
        # decoding requests apart from prefills (no query padding), each set by key length
        for members in (m for kind in (True, False)
                        for m in _query_groups([r for r in range(len(q_len))
                                                if (q_len[r] == 1) == kind], q_len, cached)):
            # [n_g] each: new tokens, cached tokens, first token's row in the step
            new, old, start = (torch.tensor([v[r] for r in members], device=device)
                               for v in (q_len, cached, starts))
            j = torch.arange(int((new + old).max()), device=device)
            key_rows = _key_slots(table.index_select(0, torch.tensor(members, device=device)),
                                  j, bs, new + old, scratch)
            a = torch.arange(int(new.max()), device=device)
            real = a[None, :] < new[:, None]  # [n_g, Lq]
            queries = torch.where(real, start[:, None] + a, T)  # (T: the dropped row)
            query_pos = torch.where(real, old[:, None] + a, 0)
            groups.append(KeyGroup(None, key_rows, j[None, None, :] <= query_pos[:, :, None],
                                   j, None, queries))
        cos, sin = self._cos_sin(w.embedding.dtype)
        last_rows = torch.tensor(starts[1:], device=device) - 1
        logits, routes = decode_forward(
            w, ctx.memory_buffer,
            DecodeBatch(tokens, positions, slots, cos, sin, groups, last_rows,
                        kv_error=self.kv_error),
            recorder is not None)
        if recorder is not None:
            owner = torch.repeat_interleave(torch.arange(len(q_len)), torch.tensor(q_len))
            recorder.record_tokens(ctx.request_ids[first:last].long().cpu()[owner],
                                   positions.cpu().clone(), routes)  # (a view of the context's)
        temperature = float(self.wrapper.temperature)
        return logits.div_(temperature) if temperature != 1.0 else logits

    def idle(self, steps: int, ep_rows: int) -> None:
        """``steps`` decoding steps of a rank without requests under EP lock-step (its experts
        serve the others': :func:`~..kernels.decode.moe_only_step`)."""
        self.weights.ep_rows = ep_rows
        for _ in range(steps):
            moe_only_step(self.weights)

    def run(self, call, plan: "Plan", steps: int, record_routes=None,
            ep_rows: int = 0) -> tuple[list[list[int]], "_Pending"]:
        """Decode ``steps`` steps (``plan``'s, or more under EP lock-step: a request never runs
        past its own end, so ``plan``'s blocks suffice); returns per step the ids of the requests
        finished at it, and the round's pending write-back (:meth:`_Pending.finish`).
        ``ep_rows``: the most requests any EP rank decodes."""
        ctx, w = self.context, self.weights
        w.ep_rows = ep_rows
        first, n, bs = plan.first, plan.n, ctx.block_size_tokens
        device = ctx.request_ids.device
        table = ctx.request_to_kv_block_ids
        self.kv.reserve(first, plan.counts, plan.need)
        pos = ctx.request_kv_length_offsets[first:first + n].long().clone()
        lk = max(plan.pos0) + steps  # the round's key window
        table_rows = table[first:first + n, : -(-lk // bs)].long()  # [n, nb]; -1: none yet
        # each request's keys by length group (eager: a long tail beside short requests costs
        # their own lengths, not n x the longest; graphs: one group)
        groups = [self._keys(table_rows, pos, plan, steps, rows, graphed=False)
                  for rows in _length_groups(plan.pos0, steps)] \
            if self.step_fn is not self.graphs else \
            [self._keys(table_rows, pos, plan, steps, None, graphed=True)]
        tokens = ctx.token_to_input_ids[:n].long().clone()
        term = ctx.request_metadata["termination_id"][first:first + n].long()
        max_len = ctx.request_output_lengths[first:first + n].long()
        cos, sin = self._cos_sin(w.embedding.dtype)
        sampler, finish = call.sampler, call.finish_rule
        temperature = float(self.wrapper.temperature)
        in_graph = (_TemperedSampler(sampler, temperature)
                    if self.step_fn is self.graphs and sampler.method == "gumbel" else None)
        alive = torch.ones(n, dtype=torch.bool, device=device)
        out_tokens, out_logprobs, live, ends, routes = [], [], [], [], []
        # every request's round in one block: its slots are that block's start + position
        base = (table_rows.gather(1, (pos // bs).unsqueeze(1)).squeeze(1) * bs - (pos // bs) * bs
                if all(p // bs == (p + steps - 1) // bs for p in plan.pos0) else None)
        for step in range(steps):
            if step >= plan.steps:  # EP lock-step past this rank's last request's end
                moe_only_step(w)
                continue
            slots = (base + pos if base is not None else
                     table_rows.gather(1, (pos // bs).unsqueeze(1)).squeeze(1) * bs + pos % bs)
            batch = DecodeBatch(tokens, pos, slots, cos, sin, [
                KeyGroup(g.rows, g.key_rows, g.positions[None, :] <= (
                    pos if g.rows is None else pos.index_select(0, g.rows))[:, None],
                    g.positions, g.key_blocks)
                for g in groups])
            if in_graph is not None:  # the graph samples too (Gumbel-max: no host read)
                (sampled, logprobs), step_routes = self.graphs(
                    w, ctx.memory_buffer, batch, record_routes is not None, sample=in_graph)
            else:
                # [n, vocab]: the output layer's real rows only (DecodeWeights.of)
                logits, step_routes = self.step_fn(w, ctx.memory_buffer, batch,
                                                   record_routes is not None)
                if temperature != 1.0:
                    logits.div_(temperature)
                sampled, logprobs = sampler(logits)
            end = alive & finish.ends(sampled, term, pos + 1, max_len)
            out_tokens.append(sampled)
            out_logprobs.append(logprobs)
            live.append(alive)
            ends.append(end)
            if step_routes is not None:
                routes.append(step_routes)
            alive = alive ^ end  # (end only where alive)
            # a finished request stays at its last position (its own block) to the round's end
            tokens, pos = sampled, pos + alive
        steps = min(steps, plan.steps)  # (the rest were this rank's experts serving others)
        ids = ctx.request_ids[first:first + n].clone()
        # the round's second host read: [2 K n] live / finished flags, then the ids
        flags = torch.cat((torch.stack(live + ends).view(-1).long(), ids.long())).tolist()
        live_host = [flags[s * n:(s + 1) * n] for s in range(steps)]
        ends_host = [flags[(steps + s) * n:(steps + s + 1) * n] for s in range(steps)]
        ids_host = flags[2 * steps * n:]
        finished = [[ids_host[r] for r in range(n) if ends_host[s][r]] for s in range(steps)]
        lived = sum(map(sum, live_host))
        self._finish_rate = sum(map(len, finished)) / lived if lived else None
        pending = _Pending(self.kv, call, plan, ids, live_host, ends_host, torch.stack(out_tokens),
                           torch.stack(out_logprobs), torch.stack(routes) if routes else None,
                           record_routes)
        return finished, pending

    def _keys(self, table_rows, pos, plan: "Plan", steps: int, rows: list[int] | None,
              graphed: bool) -> KeyGroup:
        """The keys of the requests ``rows`` (None: all) for the round (its mask set per step).

        Every slot a step reads must hold finite values (a NaN key or value poisons a softmax
        row even where it is masked; the buffer is ``torch.empty``). Keys in one block per
        request are read as one run from that block, the slots past each request's keys up to
        the window zeroed now, those an earlier round zeroed or a step wrote excepted (each
        slot zeroed once: a request's later rounds read slots it already made finite); across
        blocks the slots past the round's last position read the zeroed scratch slot, and
        those the round will write are zeroed now (each written before it is unmasked)."""
        ctx = self.context
        bs, device = ctx.block_size_tokens, pos.device
        index = None if rows is None else torch.tensor(rows, device=device)
        if index is not None:
            table_rows, pos = table_rows.index_select(0, index), pos.index_select(0, index)
        lk = max(plan.pos0[r] for r in (rows if rows is not None else range(plan.n))) + steps
        # the keys each step reads: a graph's bucket, the invariant kernels' whole chunks
        # (read in their layout, no copy: .kernels.batch_invariant.key_window), else lk
        window = (self.graphs.window(lk) if graphed else
                  bi.key_window(lk, pos) if self.weights.invariant else lk)
        scratch = ctx.block_allocator.dummy_block_idx * bs
        flat = ctx.memory_buffer.view(-1, ctx.memory_buffer.shape[2] * bs,
                                      ctx.memory_buffer[0, 0, 0, 0].numel())
        j = torch.arange(window, device=device)
        if window <= bs:
            blocks = table_rows[:, 0]
            # the slots of each request's block this round reads that may be garbage: from
            # past its cached keys, or past what an earlier round zeroed, to the window
            members = rows if rows is not None else range(plan.n)
            fresh_r, fresh_j = [], []
            for g, r in enumerate(members):
                start = max(plan.pos0[r] + 1, self._finite.get(plan.ids[r], 0))
                fresh_r += [g] * max(0, window - start)
                fresh_j += range(start, window)
                self._finite[plan.ids[r]] = max(window, start)
            if fresh_r:
                slots = (blocks.index_select(0, torch.tensor(fresh_r, device=device)) * bs
                         + torch.tensor(fresh_j, device=device))
                flat.index_fill_(1, slots, 0)
            return KeyGroup(index, blocks[:, None] * bs + j, None, j, blocks)
        j_lk = j[:lk]
        key_rows = _key_slots(table_rows, j_lk, bs, pos + plan.steps, scratch)
        ahead = (pos[:, None] + torch.arange(1, plan.steps, device=device)).clamp(max=lk - 1)
        flat.index_fill_(1, key_rows.gather(1, ahead).reshape(-1), 0)
        return KeyGroup(index, key_rows, None, j_lk, None)


class _TemperedSampler:
    """``sampler(logits / temperature)``: what a graph captures after the step (its key: the
    sampler's settings and the temperature; its generator registered with the graph)."""

    def __init__(self, sampler, temperature: float):
        self.sampler, self.temperature = sampler, float(temperature)
        self.generator = sampler.generator
        self.key = (sampler.top_k, sampler.top_p, sampler.method, self.temperature)

    def __call__(self, logits: torch.Tensor):
        if self.temperature != 1.0:
            logits = logits / self.temperature
        return self.sampler(logits)


def _key_slots(table_rows: torch.Tensor, j: torch.Tensor, bs: int, ends: torch.Tensor,
               scratch: int) -> torch.Tensor:
    """``[n, len(j)]``: the flat KV slots of keys ``j`` of each request (``table_rows [n, nb]``,
    its block table), the scratch slot at and past its ``ends [n]``."""
    return (table_rows[:, j // bs] * bs + j % bs).masked_fill(j[None, :] >= ends[:, None],
                                                              scratch)


def _query_groups(members: list[int], q_len: list[int], cached: list[int]) -> list[list[int]]:
    """``members`` (requests of a mixed step) split while padding a group's queries and keys
    to its longest would more than double them (:func:`_length_groups`' rule on the keys,
    each request's ``cached + q_len``); empty when ``members`` is."""
    if not members:
        return []
    return [[members[i] for i in g] if g is not None else members
            for g in _length_groups([cached[r] + q_len[r] for r in members], 0)]


def _length_groups(lengths: list[int], steps: int, depth: int = 3) -> list[list[int] | None]:
    """Rows of ``lengths`` (each request's cached tokens; ``steps`` more this round) split in two
    at the median, up to ``depth`` times, while padding a group to its longest would more than
    double its keys (and it has >= 8 requests, for a second attention call to pay):
    ``[None]`` when one group holds them all."""
    groups = [list(range(len(lengths)))]
    for _ in range(depth):
        split = []
        for rows in groups:
            sub = sorted(rows, key=lambda r: lengths[r])
            keys = [lengths[r] + steps for r in sub]
            if len(sub) >= 8 and len(sub) * keys[-1] > 2 * sum(keys) and keys[0] < keys[-1]:
                half = len(sub) // 2
                split += [sub[:half], sub[half:]]
            else:
                split.append(rows)
        if len(split) == len(groups):
            break
        groups = split
    return [None] if len(groups) == 1 else groups


@dataclasses.dataclass
class Plan:
    """A rank's round before it runs (:meth:`FastDecoder.plan`)."""

    first: int
    n: int
    pos0: list[int]
    counts: list[int]
    need: list[int]
    steps: int
    """The steps this rank wants: :func:`round_length`'s, or fewer when every request ends
    sooner."""
    blocks_free: bool
    """Whether the allocator holds the blocks ``need`` asks for."""
    ids: list[int]
    """The requests' ids, by row."""


@dataclasses.dataclass
class _Pending:
    """A round decoded but not yet written back (the caller decides where it ends)."""

    kv: object
    """The round's :class:`~.megatron_kv.MegatronKV`."""
    call: object
    plan: Plan
    ids: torch.Tensor
    live: list[list[bool]]
    ends: list[list[bool]]
    tokens: torch.Tensor
    """``[K, n]``."""
    logprobs: torch.Tensor
    routes: torch.Tensor | None
    """``[K, L, n, k]``."""
    recorder: object
    forwarded: int = 0
    """Live tokens the kept steps forwarded (set by :meth:`finish`)."""

    def finish(self):
        """The round's live tokens join the call (R3: their routes the recorder), Megatron's
        tables are set as after its own last step of the round, and its ``update_requests``
        runs. Returns its result (evicted request ids)."""
        plan = self.plan
        n, first = plan.n, plan.first
        steps = len(self.live)
        last_step = steps - 1
        flat = [s * n + r for s in range(steps) for r in range(n) if self.live[s][r]]
        self.forwarded = len(flat)
        device = self.tokens.device
        index = torch.tensor(flat, dtype=torch.long, device=device)
        col = index % n
        self.call.record(self.ids.index_select(0, col),
                         self.tokens[:steps].reshape(-1).index_select(0, index),
                         self.logprobs[:steps].reshape(-1).index_select(0, index))
        if self.recorder is not None:
            routes = self.routes[:steps].permute(1, 0, 2, 3).reshape(
                self.routes.shape[1], steps * n, -1).index_select(1, index)  # [L, m, k]
            positions = torch.tensor([plan.pos0[f % n] + f // n for f in flat], dtype=torch.long)
            self.recorder.record_tokens(self.ids.index_select(0, col).long().cpu(), positions,
                                        routes)
        active = torch.tensor([not any(self.ends[s][r] for s in range(steps)) for r in range(n)],
                              device=device)
        return self.kv.commit(first, plan.pos0, plan.counts, plan.need, last_step, active,
                              self.tokens[last_step].clone())
