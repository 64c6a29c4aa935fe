"""``attention.decode_plan``: a decode step's positions, cache slots and sequence lengths in one launch, against
its reference (the torch operations the captured step ran before), bit for bit: integer arithmetic only. Awkward
row counts, inactive rows, lengths on a page boundary and past the block table's width (clamped to its last page,
as the reference gathers), a view of a wider block table, int32 and int64 tables, int32 and int64 lengths out; and
its errors, which name the argument and write nothing."""

from __future__ import annotations

import pytest
import torch

from lynn_kernels import attention, runtime, use_reference

DEV = runtime.DEVICE
I32, I64 = torch.int32, torch.int64


def _case(R, W, page, seed, table_dtype=I32, seq_dtype=I32, wider=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, W * page + page, (R,), generator=g)
    lengths[0] = 0                                                   # an empty sequence
    if R > 1:
        lengths[1] = page                                            # the first token of page 1
    if R > 2:
        lengths[2] = W * page + 3                                    # past the table: its last page
    active = torch.rand(R, generator=g) < 0.7
    active[0] = True
    table = torch.randint(0, 1 << 20, (R + wider, W), generator=g).to(table_dtype)
    outs = (torch.full((R,), -7, dtype=I64), torch.full((R,), -7, dtype=I64), torch.full((R,), -7, dtype=seq_dtype))
    return [t.to(DEV) for t in (lengths, active, table[:R + wider])], page, [o.to(DEV) for o in outs]


@pytest.mark.parametrize("R, W, page, table_dtype, seq_dtype, wider", [
    pytest.param(1, 1, 16, I32, I32, 0, id="R1-one-page"),
    pytest.param(3, 5, 16, I32, I32, 2, id="R3-of-5-rows"),
    pytest.param(8, 17, 32, I64, I64, 0, id="R8-int64"),
    pytest.param(32, 260, 16, I32, I32, 0, id="R32-W260"),
    pytest.param(13, 3, 7, I32, I64, 1, id="R13-page7"),
])
def test_decode_plan_matches_reference(R, W, page, table_dtype, seq_dtype, wider):
    (lengths, active, table), page, got = _case(R, W, page, R * W, table_dtype, seq_dtype, wider)
    want = [o.clone() for o in got]
    attention.decode_plan(lengths, active, table, page, *got)
    with use_reference():
        attention.decode_plan(lengths, active, table, page, *want)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())
    positions, slots, seq = (t.cpu() for t in got)
    act = active.cpu()
    assert torch.equal(positions, lengths.cpu())
    assert bool((slots[~act] == -1).all()) and bool((seq[~act] == 0).all())
    assert torch.equal(seq[act].to(I64), lengths.cpu()[act] + 1)
    r = 0                                                            # row 0: its first page's first slot
    assert int(slots[r]) == int(table.cpu()[r, 0]) * page


@pytest.mark.parametrize("change, exc, match", [
    pytest.param(lambda a: a.update(lengths=a["lengths"].int()), TypeError, r"lengths must be int64 \[R\]",
                 id="lengths-dtype"),
    pytest.param(lambda a: a.update(active=a["active"][:-1]), TypeError, r"active must be bool \[4\]",
                 id="active-rows"),
    pytest.param(lambda a: a.update(active=a["active"].int()), TypeError, r"active must be bool", id="active-dtype"),
    pytest.param(lambda a: a.update(block_table=a["block_table"][:3]), ValueError,
                 r"block_table must be int32 / int64 \[>= 4, >= 1\]", id="table-rows"),
    pytest.param(lambda a: a.update(block_table=a["block_table"].float()), ValueError,
                 r"block_table must be int32 / int64", id="table-dtype"),
    pytest.param(lambda a: a.update(block_table=a["block_table"].t().contiguous().t()), ValueError,
                 r"block_table must have unit stride along its pages", id="table-strided"),
    pytest.param(lambda a: a.update(page_size=0), ValueError, r"page_size must be a positive int", id="page-zero"),
    pytest.param(lambda a: a.update(page_size=True), ValueError, r"page_size must be a positive int",
                 id="page-bool"),
    pytest.param(lambda a: a.update(kv_slots=a["kv_slots"].int()), ValueError,
                 r"kv_slots must be a contiguous \[4\] tensor", id="slots-dtype"),
    pytest.param(lambda a: a.update(seq_lens=torch.zeros(8, dtype=I32, device=DEV)[::2]), ValueError,
                 r"seq_lens must be a contiguous \[4\] tensor", id="seq-strided"),
    pytest.param(lambda a: a.update(positions=[0, 1, 2, 3]), TypeError, r"positions must be a torch.Tensor",
                 id="positions-list"),
])
@pytest.mark.parametrize("backend", ["kernel", "reference"])
def test_decode_plan_errors(change, exc, match, backend):
    (lengths, active, table), page, (pos, slots, seq) = _case(4, 6, 16, 5, wider=2)
    args = dict(lengths=lengths, active=active, block_table=table, page_size=page, positions=pos, kv_slots=slots,
                seq_lens=seq)
    change(args)
    before = [t.clone() for t in (pos, slots, seq)]
    with use_reference(backend == "reference"), pytest.raises(exc, match=match):
        attention.decode_plan(**args)
    assert all(torch.equal(a, b) for a, b in zip(before, (pos, slots, seq)))
