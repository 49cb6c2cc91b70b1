"""The benchmark's `hf` backend: transformers' own greedy generate, marked once per new token, on the
engine's prompt ids (so its figures stand beside the engine's in the same run)."""
import pytest
import torch

pytest.importorskip("transformers")

from test_engine_kernels import MICRO, PROMPT  # noqa: E402
from test_engine_parity import hf_generate as hf_reference  # noqa: E402
from test_engine_parity import hf_model  # noqa: E402
from workflow.stages.bench import hf_generate  # noqa: E402


def test_hf_backend_marks_every_token_and_decodes_greedily():
    hf = hf_model(MICRO)
    marks = []
    with torch.inference_mode():
        gen = hf_generate(hf, [PROMPT] * 3, 6, progress=lambda *_: marks.append(len(marks)))
    assert len(marks) == 6  # one mark per new token: the prefill's first, then each decode step
    assert gen.tokens == [hf_reference(hf, PROMPT, 6)] * 3
    # exactly the contract's count, even where the model would emit EOS first
    eos = gen.tokens[0][1]
    hf.generation_config.eos_token_id = eos
    with torch.inference_mode():
        assert [len(r) for r in hf_generate(hf, [PROMPT], 6, progress=lambda *_: None).tokens] == [6]
