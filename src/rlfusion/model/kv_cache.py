"""What attention needs to know about a forward pass: the KV cache rows it uses, or the layout
of packed (padding-free) sequences.

The cache is a set of per-layer buffers with one row (slot) per running sequence; what a layer
stores per token is the attention module's choice (GQA: keys and values per kv head; MLA: the
compressed latent and the shared RoPE key, as one head). Buffers are `[S, G, L, X]`, heads
before positions, so a run of rows read up to L positions is a strided view whose `[L, X]`
matrices a batched matmul reads in place. The rollout engine decides which slots a pass reads
and writes; the model only follows a `CacheBatch`.

Legend: S slots (or packed sequences), G heads of the cache, L max cached positions (or longest
packed sequence), X entry width, B rows in this pass, T new tokens per row, N packed tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlfusion.model.row_segments import row_segments


class KVCache:
    """Per-layer buffers shaped `[S, G, L, X]`, allocated once."""

    def __init__(self, layer_buffers: list[tuple[torch.Tensor, ...]], num_slots: int, max_len: int):
        self.layers = layer_buffers
        self.num_slots = num_slots
        self.max_len = max_len

    @property
    def nbytes(self) -> int:
        """Bytes the buffers hold right now (0 while released)."""
        return sum(b.untyped_storage().nbytes() for buffers in self.layers for b in buffers)

    def release(self) -> int:
        """Give the buffers' memory back (training runs in it); returns the bytes freed."""
        freed = self.nbytes
        for buffers in self.layers:
            for b in buffers:
                b.untyped_storage().resize_(0)
        return freed

    def restore(self) -> int:
        """Reallocate released buffers, zeroed (masked positions must not hold NaN garbage)."""
        added = 0
        for buffers in self.layers:
            for b in buffers:
                want = b.numel() * b.element_size()
                if b.untyped_storage().nbytes() < want:
                    b.untyped_storage().resize_(want)
                    b.zero_()
                    added += want
        return added

    def move_slot(self, src: int, dst: int) -> None:
        """Copy every layer's row `src` into row `dst` (used to keep running rows contiguous)."""
        for buffers in self.layers:
            for buf in buffers:
                buf[dst].copy_(buf[src])

    def read_slot(self, slot: int, positions: int) -> list[torch.Tensor]:
        """A host-memory copy of row `slot`'s first `positions` positions, one `[G, positions, X]`
        tensor per buffer (what `write_slot` puts back)."""
        return [buf[slot, :, :positions].to("cpu", copy=True) for buffers in self.layers for buf in buffers]

    def write_slot(self, slot: int, saved: list[torch.Tensor]) -> None:
        """Put a `read_slot` copy back into row `slot` (positions past it are left as they are)."""
        bufs = [buf for buffers in self.layers for buf in buffers]
        if len(saved) != len(bufs):
            raise ValueError(f"a saved cache row has {len(saved)} buffers, this cache {len(bufs)}")
        for buf, t in zip(bufs, saved):
            buf[slot, :, :t.shape[1]].copy_(t)

    def permute_slots(self, order: list[int], positions: int) -> None:
        """Rows `[0, len(order))` become rows `order` (new row i holds old row `order[i]`),
        copying each row's first `positions` positions."""
        index = torch.tensor(order, device=self.layers[0][0].device)
        for buffers in self.layers:
            for buf in buffers:
                buf[:len(order), :, :positions] = buf[index, :, :positions]


@dataclass
class CacheBatch:
    """A forward pass over cache rows `[slot_start, slot_start + B)`.

    Row b's new tokens sit at absolute positions `start_pos_B[b] + t`. Their keys/values are
    written into the cache, and each token attends to every cached position up to its own.
    """

    cache: KVCache
    slot_start: int
    start_pos_B: torch.Tensor  # int64 [B]


@dataclass
class PackedSeqs:
    """Sequences concatenated along the token axis with no padding (`tokens_1N`).

    `cu_seqlens` holds the offsets `[0, len_0, len_0 + len_1, ..., N]`; attention is restricted
    to each sequence and positions restart at 0 for each one.
    """

    cu_seqlens: torch.Tensor  # int64 [S + 1]

    @classmethod
    def from_lengths(cls, lengths: list[int]) -> "PackedSeqs":
        if not lengths or min(lengths) < 1:
            raise ValueError(f"packed sequence lengths must be >= 1, got {lengths[:8]}")
        cu = torch.zeros(len(lengths) + 1, dtype=torch.long)
        cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
        return cls(cu)

    @property
    def lengths(self) -> torch.Tensor:
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]


@dataclass
class AttnContext:
    """Per-pass values shared by every layer (computed once in the model's forward)."""

    pos_BT: torch.Tensor  # absolute position of each new token
    cache: KVCache | None = None
    slot_start: int = 0
    kv_len: int = 0  # number of cached positions to attend over
    mask_B1TL: torch.Tensor | None = None  # True where a query may attend to a cached key
    # The same pass as runs of rows (`row_segments`): (first row, end row, positions read, mask
    # `[n, 1, 1, T, positions]` True where a query may attend, or None where every query sees
    # every position). Attention reads each run's rows only up to its own longest.
    segments: list[tuple[int, int, int, torch.Tensor | None]] | None = None
    # Packed sequences: attention runs on right-padded [S_b, L_b] views, one per bucket of
    # sequences of similar length (`unpad_SL[b]`: indices into the N packed tokens), and returns
    # through `repack_N` (for each packed token, its position in the buckets' flattened S_b*L_b
    # views, concatenated). Token-wise layers never see padding.
    unpad_SL: list[torch.Tensor] | None = None
    repack_N: torch.Tensor | None = None
    # Packed prefill into the cache: the cache row (slot) of each packed token; its position is
    # `pos_BT[0]`. The sequences start at position 0, so attention needs nothing from the cache.
    cache_rows_N: torch.Tensor | None = None
    rope: dict = field(default_factory=dict)  # cos/sin gathered once per pass (see Rotary)

    @classmethod
    def build(cls, num_rows: int, num_tokens: int, batch: CacheBatch | None,
              device: torch.device, packed: PackedSeqs | None = None) -> "AttnContext":
        steps_T = torch.arange(num_tokens, device=device)
        if packed is not None:
            ctx = cls._packed(packed, num_rows, num_tokens, device)
            if batch is not None:  # a packed prefill: each sequence fills its own cache row
                if bool(batch.start_pos_B.ne(0).any()):
                    raise ValueError("a packed prefill starts every sequence at position 0 (nothing cached)")
                lengths_S = packed.lengths.to(device)
                if int(lengths_S.max()) > batch.cache.max_len:
                    raise ValueError(f"sequence length {int(lengths_S.max())} exceeds the KV cache length "
                                     f"{batch.cache.max_len}")
                rows_S = torch.arange(len(lengths_S), device=device) + batch.slot_start
                ctx.cache = batch.cache
                ctx.cache_rows_N = torch.repeat_interleave(rows_S, lengths_S, output_size=num_tokens)
            return ctx
        if batch is None:
            return cls(pos_BT=steps_T.unsqueeze(0).expand(num_rows, -1))
        pos_BT = batch.start_pos_B.to(device).unsqueeze(1) + steps_T
        kv_len = int(pos_BT.max()) + 1
        if kv_len > batch.cache.max_len:
            raise ValueError(f"sequence position {kv_len - 1} exceeds the KV cache length "
                             f"{batch.cache.max_len}")
        keys_L = torch.arange(kv_len, device=device)
        mask = keys_L.view(1, 1, 1, -1) <= pos_BT.unsqueeze(1).unsqueeze(-1)
        lengths = (pos_BT[:, -1] + 1).tolist()
        segments = [(start, end, positions,
                     None if num_tokens == 1 and min(lengths[start:end]) == positions
                     else mask[start:end, :, :, :positions].unsqueeze(1))
                    for start, end, positions in row_segments(lengths)]
        return cls(pos_BT=pos_BT, cache=batch.cache, slot_start=batch.slot_start,
                   kv_len=kv_len, mask_B1TL=mask, segments=segments)

    @classmethod
    def _packed(cls, packed: PackedSeqs, num_rows: int, num_tokens: int,
                device: torch.device) -> "AttnContext":
        cu = packed.cu_seqlens.to(device)
        if num_rows != 1 or int(cu[-1]) != num_tokens:
            raise ValueError(f"packed input must be [1, {int(cu[-1])}] to match cu_seqlens, got "
                             f"[{num_rows}, {num_tokens}]")
        lengths_S = cu[1:] - cu[:-1]
        starts_N = torch.repeat_interleave(cu[:-1], lengths_S, output_size=num_tokens)
        pos_1N = (torch.arange(num_tokens, device=device) - starts_N).unsqueeze(0)
        unpad, flat_parts, token_parts, offset = [], [], [], 0
        for seqs_S in _length_buckets(lengths_S):
            lengths_b = lengths_S[seqs_S]
            steps_L = torch.arange(int(lengths_b.max()), device=device)
            valid_SL = steps_L < lengths_b.unsqueeze(1)
            tokens_SL = torch.where(valid_SL, cu[seqs_S].unsqueeze(1) + steps_L, 0)
            unpad.append(tokens_SL)
            flat_parts.append(valid_SL.flatten().nonzero().squeeze(1) + offset)
            token_parts.append(tokens_SL[valid_SL])
            offset += valid_SL.numel()
        repack_N = torch.empty(num_tokens, dtype=torch.long, device=device)
        repack_N[torch.cat(token_parts)] = torch.cat(flat_parts)
        return cls(pos_BT=pos_1N, unpad_SL=unpad, repack_N=repack_N)


# sequences whose lengths are within this factor of a bucket's longest share its padded view
BUCKET_LENGTH_RATIO = 1.5


def _length_buckets(lengths_S: torch.Tensor) -> list[torch.Tensor]:
    """Sequence indices grouped, longest first, so that each group's padded attention view wastes
    little: a group holds the longest remaining sequence and every one at least 1/`ratio` as
    long. Padding everything to the longest would cost S * L_max^2 attention, mostly on padding,
    when one long response sits among short ones."""
    order_S = torch.argsort(lengths_S, descending=True, stable=True)
    sorted_S = lengths_S[order_S].tolist()
    buckets, start = [], 0
    while start < len(sorted_S):
        end = start + 1
        while end < len(sorted_S) and sorted_S[end] * BUCKET_LENGTH_RATIO >= sorted_S[start]:
            end += 1
        buckets.append(order_S[start:end])
        start = end
    return buckets
