"""The first guidance branch's output handed over before it is computed (`hooks.lazy_output`): picks and slices are
deferred, any other use waits for it and acts on the real tensors, and the output is gathered once however many
parts of it the pipeline holds."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import torch
from diffusers.models.modeling_outputs import Transformer2DModelOutput

from hooks.lazy_output import LazyOutput, resolved


def test_picks_and_slices_wait_for_nothing_other_uses_wait_and_see_the_real_tensor():
    future, gathered = Future(), []
    lazy = LazyOutput(future, lambda output: gathered.append(1) or output)
    first = lazy[0][:, :2]  # Qwen-Image drops its image tokens before its second call
    assert not gathered and not future.done()  # nothing waited for yet
    value = torch.arange(6.0).reshape(2, 3)
    threading.Timer(0.01, future.set_result, args=((value,),)).start()
    torch.testing.assert_close(first - 1, value[:, :2] - 1)  # waits, then the tensor's own operator
    torch.testing.assert_close(torch.norm(lazy[0]), torch.norm(value))  # torch functions: __torch_function__
    torch.testing.assert_close(2 * lazy[0] + lazy[0], 3 * value)
    assert gathered == [1]  # gathered once for every part
    other = Future()
    other.set_result(Transformer2DModelOutput(sample=value))
    torch.testing.assert_close(LazyOutput(other, lambda output: output).sample * 1, value)  # a field, deferred
    assert resolved({"a": [first]})["a"][0].shape == (2, 2)
