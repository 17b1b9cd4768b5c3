"""A Megatron model's weights as pieces (:class:`~gspo_megatron.weight_pieces.WeightPiece`): what
each trainer rank of ``rollout.placement: separate`` sends after every optimizer step, and what a
rollout rank's replica loads (:mod:`gspo_megatron.rollouts.weight_channel` moves them).

Both ends read the model's ``sharded_state_dict`` (the description ``dist_checkpointing`` saves
by): every tensor a rank holds is a :class:`ShardedTensor` with a layout-independent key, the
global shape and its offset in it, so a piece sent from one TP / EP / PP layout lands in the
right window of another's. A trainer rank sends only the pieces it holds the main replica of
(``is_main_replica``: over the trainer's ranks, every element once, as a checkpoint writes it); a
replica loads into all of its pieces. The pieces are views of the parameters: nothing is copied
until the sender's snapshot or the receiver's load.
"""

from __future__ import annotations

from gspo_megatron.weight_pieces import WeightPiece


def _shards(gpt_model) -> list:
    """This rank's :class:`ShardedTensor` pieces of ``gpt_model`` (factories such as the SwiGLU
    split built: their pieces are views of the parameters)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    state = gpt_model.sharded_state_dict()
    apply_factories(state)
    return [t for t in nested_values(state)
            if isinstance(t, ShardedTensor) and t.flattened_range is None]


def _piece(t) -> WeightPiece:
    """A shard as a piece: its data with the prepended axes as size-1 axes (indexing with None:
    a view, written through)."""
    return WeightPiece(t.key, tuple(t.global_shape), tuple(t.global_offset),
                       t.data.detach()[(None,) * t.prepend_axis_num])


class ShardIndex:
    """The pieces of one model, built once: ``sharded_state_dict()`` and its factories cost
    ~2.6 ms a call on the tiny model, on both ends of every weight transfer. The pieces are views
    of the parameters, so they stay valid while no parameter's storage moves; the index is
    rebuilt when one does (a parameter's ``data`` replaced), in the same order."""

    def __init__(self, gpt_model):
        self.model = gpt_model
        self._storages: tuple[int, ...] | None = None
        self._all: list[WeightPiece] = []
        self._main: list[WeightPiece] = []

    def _refresh(self) -> None:
        from megatron.core.dist_checkpointing.mapping import is_main_replica

        storages = tuple(p.data_ptr() for p in self.model.parameters())
        if storages != self._storages:
            shards = _shards(self.model)
            self._all = [_piece(t) for t in shards]
            self._main = [p for p, t in zip(self._all, shards) if is_main_replica(t.replica_id)]
            self._storages = storages

    def pieces(self, main_only: bool = False) -> list[WeightPiece]:
        """Every piece this rank holds (what a replica loads into), or only those it holds the
        main replica of (``main_only``: what a trainer rank sends)."""
        self._refresh()
        return self._main if main_only else self._all
