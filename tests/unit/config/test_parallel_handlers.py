"""Accelerate's ParallelismConfig handlers (tp/cp/sp_handler) and 1.16's refusal of linear-attention layers under
sequence/context parallelism (their recurrent state would restart on every rank: wrong gradients, no error)."""

import types

import pytest
import torch

from accel.parallel.sequence import SequenceParallel
from accel.config import ConfigError, ParallelismConfig
from accel.utils import DeepSpeedSequenceParallelConfig, TorchContextParallelConfig, TorchTensorParallelConfig


def test_handlers_take_accelerates_environment(monkeypatch):
    sp = DeepSpeedSequenceParallelConfig()
    assert (sp.sp_seq_length_is_variable, sp.sp_allow_recurrent_layers, sp.sp_disable_in_eval) == (True, False, True)
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_ALLOW_RECURRENT_LAYERS", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SEQ_LENGTH_IS_VARIABLE", "false")
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SEQ_LENGTH", "256")
    sp = DeepSpeedSequenceParallelConfig()
    assert sp.sp_allow_recurrent_layers and sp.sp_seq_length == 256
    monkeypatch.delenv("PARALLELISM_CONFIG_SP_SEQ_LENGTH")
    with pytest.raises(ValueError, match="sp_seq_length` must be provided"):
        DeepSpeedSequenceParallelConfig()
    with pytest.raises(ValueError, match="Invalid cp_comm_strategy: nope"):
        TorchContextParallelConfig(cp_comm_strategy="nope")
    with pytest.warns(UserWarning, match="Async tensor parallelism"):
        TorchTensorParallelConfig(enable_async_tp=True)
    config = ParallelismConfig(cp_size=2, cp_handler=TorchContextParallelConfig(cp_comm_strategy="alltoall"),
                               sp_handler=sp)
    assert config.cp_comm_strategy == "ring" and config.sp_handler is sp  # Accelerate's alltoall is accel's ring


@pytest.mark.parametrize("kind", ["sp", "cp"])
def test_linear_attention_layers_are_refused_unless_allowed(kind):
    transformers = pytest.importorskip("transformers")
    config = transformers.BambaConfig(num_hidden_layers=2, attn_layer_indices=[1])
    assert "linear_attention" in config.layer_types
    model = torch.nn.Linear(2, 2)
    sequence = types.SimpleNamespace(kind=kind, allow_recurrent=False)
    with pytest.raises(ConfigError, match=r"parallelism: Linear has attention layers of type \['linear_attention'\] "
                                          r"\(BambaConfig.layer_types\).*sp_allow_recurrent_layers=True"):
        SequenceParallel._refuse_recurrent_layers(sequence, model, config)
    sequence.allow_recurrent = True
    SequenceParallel._refuse_recurrent_layers(sequence, model, config)  # the user says the model passes the state
    full = transformers.LlamaConfig(num_hidden_layers=2)
    SequenceParallel._refuse_recurrent_layers(types.SimpleNamespace(kind=kind, allow_recurrent=False), model, full)
