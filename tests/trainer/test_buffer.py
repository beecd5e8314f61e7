"""RolloutBuffer: minibatches cover each row exactly once; model inputs rebuilt from the padding."""

from __future__ import annotations

import pytest
import torch

from pyppo.trainer.buffer import RolloutBuffer


def make_buffer(B=10, P=4, T=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.randint(1, P + 1, (B,), generator=g)
    query_mask = torch.arange(P).unsqueeze(0) >= (P - prompt_len).unsqueeze(1)  # left padding
    resp_len = torch.randint(1, T + 1, (B,), generator=g)
    response_mask = torch.arange(T).unsqueeze(0) < resp_len.unsqueeze(1)
    buf = RolloutBuffer(
        query_ids=torch.randint(3, 50, (B, P), generator=g),
        query_mask=query_mask,
        response_ids=torch.randint(3, 50, (B, T), generator=g),
        response_mask=response_mask,
        old_logprobs=torch.arange(B * T, dtype=torch.float32).reshape(B, T),
        scores=torch.arange(B, dtype=torch.float32),
        prompts=[f"p{i}" for i in range(B)],
    )
    return buf


@pytest.mark.parametrize("B, mb", [(10, 5), (10, 3), (8, 8), (7, 1)])
def test_minibatches_cover_each_row_once(B, mb):
    buf = make_buffer(B=B)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):  # several epochs, each a fresh shuffle
        seen = []
        sizes = []
        for m in buf.minibatches(mb, g):
            sizes.append(len(m))
            rows = m.scores.long().tolist()
            seen += rows
            # every field of a row travels together
            assert m.prompts == [f"p{r}" for r in rows]
            torch.testing.assert_close(m.old_logprobs, buf.old_logprobs[rows])
            assert torch.equal(m.response_mask, buf.response_mask[rows])
        assert sorted(seen) == list(range(B))
        assert sizes == [mb] * (B // mb) + ([B % mb] if B % mb else [])


def test_shuffle_is_seeded_and_random():
    buf = make_buffer(B=16)
    orders = []
    for seed in (0, 0, 1):
        g = torch.Generator().manual_seed(seed)
        orders.append([r for m in buf.minibatches(4, g) for r in m.scores.long().tolist()])
    assert orders[0] == orders[1] != orders[2]
    assert orders[0] != list(range(16))


def test_explicit_permutation_and_errors():
    buf = make_buffer(B=6)
    perm = torch.tensor([5, 0, 3, 1, 4, 2])
    order = [r for m in buf.minibatches(4, permutation=perm) for r in m.scores.long().tolist()]
    assert order == perm.tolist()
    with pytest.raises(ValueError, match="permutation"):
        list(buf.minibatches(2, permutation=torch.tensor([0, 0, 1, 2, 3, 4])))
    with pytest.raises(ValueError, match="mini_batch_size"):
        list(buf.minibatches(0))
    with pytest.raises(ValueError, match="micro_batch_size"):
        list(buf.micro_batches(0))


def test_micro_batches_are_consecutive_chunks():
    buf = make_buffer(B=10)
    chunks = [m.scores.long().tolist() for m in buf.micro_batches(4)]
    assert chunks == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_model_inputs_from_left_padding():
    buf = make_buffer(B=5, P=4, T=3)
    ids, am, pos = buf.input_ids, buf.attention_mask, buf.position_ids
    assert ids.shape == am.shape == pos.shape == (5, 7)
    assert torch.equal(ids[:, :4], buf.query_ids) and torch.equal(ids[:, 4:], buf.response_ids)
    for b in range(5):
        first = int(buf.query_mask[b].long().argmax())
        # position 0 at the first real prompt token, counting through the response
        assert pos[b, first].item() == 0
        assert pos[b, 4].item() == 4 - first
        assert torch.equal(am[b], torch.cat([buf.query_mask[b], buf.response_mask[b]]).long())


def test_shape_validation_names_the_field():
    buf = make_buffer(B=4, T=5)
    with pytest.raises(ValueError, match="old_logprobs"):
        RolloutBuffer(
            buf.query_ids, buf.query_mask, buf.response_ids, buf.response_mask, old_logprobs=torch.zeros(4, 6)
        )
    with pytest.raises(ValueError, match="scores"):
        RolloutBuffer(buf.query_ids, buf.query_mask, buf.response_ids, buf.response_mask, scores=torch.zeros(3))
    with pytest.raises(ValueError, match="response_ids"):
        RolloutBuffer(buf.query_ids, buf.query_mask, buf.response_ids[:3], buf.response_mask[:3])
    with pytest.raises(ValueError, match="prompts"):
        RolloutBuffer(buf.query_ids, buf.query_mask, buf.response_ids, buf.response_mask, prompts=["a"])
