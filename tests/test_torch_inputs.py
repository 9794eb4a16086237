"""CPU torch tensors go in wherever arrays do, read in place, and torch tensors come back.

Skipped without torch (the ``hf`` extra); CI installs it in a step of its own.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.managers import make_manager, manager_state

from pagedkv.errors import InputTypeError, NonFiniteError, ShapeError
from pagedkv.inputs import as_vectors, check_tokens, is_torch_tensor, torch_array

torch = pytest.importorskip("torch")


def test_a_tensor_is_read_in_place() -> None:
    tensor = torch.arange(6, dtype=torch.float64).reshape(1, 2, 3)
    array, _ = check_tokens("k", tensor, np.dtype(np.float64), (1, 2, 3))
    assert np.shares_memory(array, tensor.numpy())
    assert is_torch_tensor(tensor) and not is_torch_tensor(array)


def test_bfloat16_is_widened_exactly_and_grad_tensors_are_read() -> None:
    tensor = torch.tensor([1.5, -2.25, 3.0], dtype=torch.bfloat16)
    assert torch_array("q", tensor).tolist() == [1.5, -2.25, 3.0]
    grad = torch.ones(2, requires_grad=True)
    assert as_vectors("q", grad, np.dtype(np.float32))[0].tolist() == [1.0, 1.0]
    negated = torch.ones(2, dtype=torch.complex64).conj().real  # a view with a lazy bit
    assert torch_array("q", negated).tolist() == [1.0, 1.0]


def test_bad_tensors_get_the_same_errors_as_arrays() -> None:
    dtype = np.dtype(np.float64)
    with pytest.raises(NonFiniteError, match="k holds nan"):
        check_tokens("k", torch.tensor([[[float("nan")]]], dtype=torch.float64), dtype, (1, 1, 1))
    with pytest.raises(ShapeError, match="shape"):
        check_tokens("k", torch.zeros(2, 1, 1, dtype=torch.float64), dtype, (1, 1, 1))
    with pytest.raises(InputTypeError, match="complex"):
        as_vectors("q", torch.zeros(2, dtype=torch.complex64), dtype)
    with pytest.raises(InputTypeError, match="bools"):
        as_vectors("q", torch.zeros(2, dtype=torch.bool), dtype)
    meta = torch.zeros(2, device="meta")
    with pytest.raises(InputTypeError, match=r"on meta; pagedkv computes on the CPU: pass q.cpu\(\)"):
        as_vectors("q", meta, dtype)


def test_the_manager_takes_tensors_and_gives_tensors_back() -> None:
    manager = make_manager(4, num_kv_heads=2, head_dim=3)
    twin = make_manager(4, num_kv_heads=2, head_dim=3)
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((3, 2, 3)) for _ in range(3))
    outs = []
    for m, convert in [(manager, torch.from_numpy), (twin, lambda a: a)]:
        m.add_sequence("a")
        batch = m.reserve({"a": 3})
        m.write(0, batch, convert(k), convert(v))
        outs.append(m.attend(0, batch, convert(q)))
    assert isinstance(outs[0], torch.Tensor) and isinstance(outs[1], np.ndarray)
    np.testing.assert_array_equal(outs[0].numpy(), outs[1])
    assert manager_state(manager) == manager_state(twin)


def test_a_refused_tensor_changes_nothing() -> None:
    manager = make_manager(4)
    manager.add_sequence("a")
    batch = manager.reserve({"a": 1})
    before = manager_state(manager)
    with pytest.raises(NonFiniteError):
        manager.write(0, batch, torch.tensor([[[float("inf")]]], dtype=torch.float64), torch.zeros(1, 1, 1))
    assert manager_state(manager) == before


def test_a_cache_gives_a_tensor_back_for_a_tensor_query() -> None:
    from pagedkv import KVCache

    cache, twin = KVCache(), KVCache()
    q, k, v = (np.arange(4.0).reshape(2, 2) + i for i in range(3))
    out = cache.attend(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v))
    assert isinstance(out, torch.Tensor)
    np.testing.assert_array_equal(out.numpy(), twin.attend(q, k, v))
