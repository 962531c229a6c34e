"""StepBuffers (runner/buffers.py): the persistent buffers a GraphRunner owns and the views a step reads."""

from __future__ import annotations

import torch

import piecewise_backend as pb
from piecewise_backend.inputs import is_persistent
from piecewise_backend.runner.buffers import StepBuffers

CPU = torch.device("cpu")


def buffers(**kw) -> StepBuffers:
    inputs = [
        pb.StaticInput("ids", pad=-1),
        pb.StaticInput("rows", request_row=True),
        pb.StaticInput("feats", shape=(3,), dtype=torch.float32, pad=0.5),
        pb.StaticInput("blocks", shape=(2,), per="request", pad=7),
    ]
    return StepBuffers(inputs, tokens=8, max_num_reqs=4, device=CPU, **kw)


def test_one_buffer_per_input_sized_by_tokens_or_requests_and_filled_with_its_pad():
    b = buffers()
    assert {k: tuple(t.shape) for k, t in b.tensors.items()} == {
        "ids": (8,), "rows": (8,), "feats": (8, 3), "blocks": (4, 2)
    }
    assert b.tensors["ids"].eq(-1).all() and b.tensors["feats"].eq(0.5).all() and b.tensors["blocks"].eq(7).all()
    assert b.per_request == {"blocks"} and b.request_row == {"rows"}
    assert (b.rows("ids", 5), b.rows("blocks", 5)) == (5, 4)
    assert all(is_persistent(t) for t in b.tensors.values())
    assert b.storages == {t.untyped_storage().data_ptr() for t in b.tensors.values()}


def test_views_are_the_leading_token_rows_and_every_request_row():
    b = buffers()
    views = b.views(5)
    assert {k: tuple(v.shape) for k, v in views.items()} == {"ids": (5,), "rows": (5,), "feats": (5, 3), "blocks": (4, 2)}
    assert all(v.untyped_storage().data_ptr() in b.storages for v in views.values())


def test_fill_copies_a_step_and_pads_the_rest_of_its_rows():
    b = buffers()
    b.tensors["ids"].fill_(99)  # a previous, longer step
    batch = {
        "ids": torch.tensor([1, 2, 3]), "rows": torch.tensor([0, 0, 1]),
        "feats": torch.ones(3, 2), "blocks": torch.tensor([[1, 2], [3, 4]]),
    }
    b.fill(batch, 4)
    assert b.tensors["ids"].tolist() == [1, 2, 3, -1, 99, 99, 99, 99]  # padded to 4 rows; beyond: untouched
    assert b.tensors["feats"][:4].tolist() == [[1, 1, 0.5]] * 3 + [[0.5] * 3]  # a narrower tensor: pad columns
    assert b.tensors["blocks"].tolist() == [[1, 2], [3, 4], [7, 7], [7, 7]]  # every request row
    b.reset()
    assert b.tensors["ids"].eq(-1).all() and b.tensors["blocks"].eq(7).all()


def test_a_planned_fill_of_full_width_tensors_matches_the_general_fill():
    """``counts`` (every tensor as wide as its buffer): one copy planned per row counts, pads included."""
    planned, general = buffers(), buffers()
    for b in (planned, general):
        for t in b.tensors.values():
            t.fill_(99)  # a previous, longer step
    for n, reqs, tokens in ((3, 2, 4), (1, 1, 1), (3, 2, 4), (2, 4, 8)):
        batch = {
            "ids": torch.arange(n), "rows": torch.zeros(n, dtype=torch.long), "feats": torch.rand(n, 3),
            "blocks": torch.arange(2 * reqs).reshape(reqs, 2),
        }
        planned.fill(batch, tokens, (n, reqs))
        general.fill(batch, tokens)
        for name, t in planned.tensors.items():
            assert torch.equal(t, general.tensors[name]), (name, n, reqs, tokens)
    assert planned.tensors["blocks"].tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert planned.tensors["ids"][:8].tolist() == [0, 1, -1, -1, -1, -1, -1, -1]


def test_eager_views_pass_the_step_s_own_tensors_when_they_fit_as_they_are():
    b = buffers()
    ids, blocks = torch.tensor([1, 2, 3]), torch.tensor([[1, 2]] * 4)
    views = b.eager_views({"ids": ids, "rows": torch.zeros(3, dtype=torch.long), "feats": torch.ones(3, 2),
                           "blocks": blocks}, 3)
    assert views["ids"] is ids and views["blocks"] is blocks
    assert views["feats"].tolist() == [[1, 1, 0.5]] * 3  # padded to the spec's width, like a graph step's
    assert all(v.untyped_storage().data_ptr() not in b.storages for v in views.values())  # never the buffers


def test_fill_pads_every_row_a_step_does_not_write_whatever_was_there_before():
    """The fast fill (one _foreach_copy_ into row views kept per row count) writes pad below the data on every
    step, a narrower tensor's columns too, with dtype conversion; step_views are the same objects each step."""
    b = buffers()
    for n, reqs in ((3, 2), (1, 1), (3, 2), (2, 1)):
        b.fill({"ids": torch.arange(n) + 10, "rows": torch.zeros(n, dtype=torch.long),
                "feats": torch.ones(n, 3, dtype=torch.float64), "blocks": torch.full((reqs, 1), 2)}, 4)
        assert b.tensors["ids"][:4].tolist() == [10 + i for i in range(n)] + [-1] * (4 - n)
        assert b.tensors["feats"][:4].tolist() == [[1.0] * 3] * n + [[0.5] * 3] * (4 - n)
        assert b.tensors["blocks"].tolist() == [[2, 7]] * reqs + [[7, 7]] * (4 - reqs)  # narrower: columns padded
    assert b.step_views(4) is b.step_views(4) and b.step_views(4)["ids"] is b.step_views(4)["ids"]
    assert {k: tuple(v.shape) for k, v in b.step_views(2).items()} == {k: tuple(v.shape) for k, v in b.views(2).items()}
