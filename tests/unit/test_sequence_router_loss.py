"""sp/cp refuse a MoE model's router auxiliary loss: each rank would compute it on its
slice only, the loss would count it sp_size times and its gradient would not be the whole sequence's (tiny Mixtral,
sp 2: loss 4.592 against one process's 4.392, no error). The plain MoE (no router loss) runs and is tested on 4
processes in tests/multiproc/test_sequence_resume.py."""

import types

import pytest
import torch

from accel.parallel.sequence import SequenceParallel
from accel.config import ConfigError


@pytest.mark.parametrize("kind", ["sp", "cp"])
def test_router_auxiliary_loss_is_refused_in_one_line(kind):
    transformers = pytest.importorskip("transformers")
    model = torch.nn.Linear(2, 2)
    sequence = types.SimpleNamespace(kind=kind)
    config = transformers.MixtralConfig(num_hidden_layers=1, output_router_logits=True, router_aux_loss_coef=0.1)
    with pytest.raises(ConfigError, match=rf"^{'sequence' if kind == 'sp' else 'context'} parallelism: Linear adds "
                                          r"its router's auxiliary loss \(MixtralConfig.output_router_logits=True, "
                                          rf"router_aux_loss_coef=0.1\).*allowed: .* or {kind}_size 1$"):
        SequenceParallel._refuse_router_loss(sequence, model, config)
    plain = transformers.MixtralConfig(num_hidden_layers=1)  # output_router_logits False: the plain MoE
    SequenceParallel._refuse_router_loss(sequence, model, plain)
    with pytest.raises(ConfigError, match=r"forward.s output_router_logits=True"):  # model(..., the flag)
        SequenceParallel._refuse_router_loss(sequence, model, plain, in_forward=True)
    SequenceParallel._refuse_router_loss(sequence, model, transformers.MixtralConfig(
        num_hidden_layers=1, output_router_logits=True, router_aux_loss_coef=0.0))  # no loss added: nothing to refuse
