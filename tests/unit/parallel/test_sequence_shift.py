"""Label shifting and the token-weighted loss under sequence/context parallelism (accel/parallel/sequence.py,
sequence_layout.py), in one process: each rank's slice of the labels shifted over the WHOLE sequence, accel's
padding ignored even in labels built from input_ids, and the reduction of a loss computed outside the model. The
group's collectives are simulated (every rank's slice is known here); tests/multiproc/parallelism/test_sequence.py runs them."""

import pytest
import torch

from accel.parallel.sequence import SequenceParallel
from accel.parallel.sequence_layout import SequenceLayout, cut_batch, real_length, shift_labels


def group(degree: int, rank: int, balanced: bool, whole: torch.Tensor | None = None) -> SequenceParallel:
    """A SequenceParallel without a process group: `whole` stands for the all-gather's result."""
    sequence = SequenceParallel.__new__(SequenceParallel)
    sequence.kind, sequence.degree = ("cp" if balanced else "sp"), degree
    sequence.layout = SequenceLayout(degree, rank, balanced)
    sequence.whole = lambda local: whole  # type: ignore[method-assign]
    return sequence


@pytest.mark.parametrize("balanced", [False, True])
def test_every_slice_gets_the_next_token_of_the_whole_sequence(balanced):
    tokens = torch.arange(10, 18)[None]  # 8 tokens: 2 ranks, 4 each (cp: chunks of 2)
    expected = torch.tensor([[11, 12, 13, 14, 15, 16, 17, -100]])
    for rank in range(2):
        sequence = group(2, rank, balanced, whole=tokens)
        local = sequence.layout.cut(tokens)
        mine = sequence.shift_labels(local)
        assert mine.tolist() == sequence.layout.cut(expected).tolist()
        # the slice shifted alone (what the model did before: 3.998 vs 4.583) loses the label of its last token
        assert mine[:, -1].item() != -100 or sequence.layout.indices(8)[-1].item() == 7
        # given whole, the labels are cut after the shift (no gather)
        assert sequence.shift_labels(tokens, local=4).tolist() == mine.tolist()


def test_labels_of_an_unexpected_length_are_one_line():
    sequence = group(2, 0, False, whole=None)
    with pytest.raises(ValueError, match=r"labels of shape \(1, 6\) with input_ids of 4 tokens per sp rank"):
        sequence.shift_labels(torch.zeros(1, 6, dtype=torch.long), local=4)


def test_padding_added_by_accel_is_never_a_label_even_of_input_ids():
    ids = torch.arange(1, 7)[None]  # length 6, cp 2: padded to 8 with input_ids 0
    cut = [cut_batch({"input_ids": ids}, SequenceLayout(2, r, True), True)["input_ids"] for r in range(2)]
    assert [real_length(c) for c in cut] == [6, 6]
    padded = torch.cat([ids, torch.zeros(1, 2, dtype=torch.long)], dim=1)
    shifted = [group(2, r, True, whole=padded).shift_labels(cut[r], real=real_length(cut[r])) for r in range(2)]
    # rank 0 holds positions 0, 1, 6, 7; rank 1 positions 2..5: token 6 (position 5) predicts nothing, not the 0
    assert shifted[0].tolist() == [[2, 3, -100, -100]] and shifted[1].tolist() == [[4, 5, 6, -100]]
    assert shift_labels(padded).tolist() == [[2, 3, 4, 5, 6, 0, 0, -100]]  # without the real length: wrong


def test_tuple_batches_needing_padding_are_refused_naming_the_fix():
    """A tuple has no attention mask to mask padding with, nor a way to tell labels from inputs: refused, as a
    ConfigError (one line on rank 0 in a launched job), naming the layout and the fixes."""
    from accel.parallel.sequence_layout import SequenceCutError
    from accel.config.errors import ConfigError

    assert issubclass(SequenceCutError, ConfigError)
    with pytest.raises(SequenceCutError, match="^context parallelism: the batch's first tensor has sequence length "
                                               r"14, which does not divide into 4 equal parts \(2 x cp_size\).*or a "
                                               "dict batch with input_ids, which accel pads$"):
        cut_batch((torch.zeros(2, 14, dtype=torch.long),), SequenceLayout(2, 0, True), True)


def test_reduce_token_loss_is_the_whole_mean_with_one_process_gradient():
    """Two ranks with 3 and 1 counted tokens: every rank reports the whole mean, and the data-parallel average of the
    gradients over the 2 ranks (dp x sp's divisor) is the whole mean's gradient."""
    weight = torch.tensor(2.0, requires_grad=True)
    token_losses = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([5.0])]
    whole = (weight * torch.cat(token_losses)).mean()
    (expected,) = torch.autograd.grad(whole, weight)
    sums = [(weight * t).sum() for t in token_losses]
    grads, values = [], []
    for rank in range(2):
        sequence = group(2, rank, False)
        other = 1 - rank

        calls = iter([float(len(token_losses[other])), sums[other].item() / 4])  # the count, then the loss

        def all_reduce(tensor, calls=calls):  # what the group's sum gives: this rank's + the other's
            return tensor.add_(next(calls))
        sequence.all_reduce = all_reduce  # type: ignore[method-assign]
        value = sequence.reduce_token_loss(sums[rank], len(token_losses[rank]))
        values.append(value.item())
        grads.append(torch.autograd.grad(value, weight, retain_graph=True)[0])
    assert values == pytest.approx([whole.item()] * 2, abs=1e-6)
    torch.testing.assert_close(sum(grads) / 2, expected, atol=1e-6, rtol=0)
