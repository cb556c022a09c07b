"""test_hf_models.py's checks on the backends compiled regionally with inductor (DDP, ZeRO-3 with full activation
checkpointing, TP 2, PP 2), in their own launch: inductor's first compilation of each block is the slowest part of
the matrix, and a module of its own lets a second pytest worker run it beside the rest."""

import pytest
from test_hf_models import COMPILED, cases, check_model_matches_one_process, check_ties_resume_and_from_pretrained, \
    launch_matrix

pytestmark = pytest.mark.multiproc
pytest.importorskip("transformers")

CASES = cases(COMPILED)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return launch_matrix(tmp_path_factory, ((2, COMPILED),))


@pytest.mark.parametrize("backend,name", CASES, ids=[f"{b}-{m}" for b, m in CASES])
def test_compiled_model_matches_one_process(runs, backend, name):
    check_model_matches_one_process(runs, backend, name)


@pytest.mark.parametrize("backend,name", CASES, ids=[f"{b}-{m}" for b, m in CASES])
def test_compiled_ties_resume_and_from_pretrained(runs, backend, name):
    check_ties_resume_and_from_pretrained(runs, backend, name)
