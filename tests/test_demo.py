"""The demo's language model (rms_norm with fused residuals, attention, fused_moe and a shared
gated_linear_unit expert, a linear_softmax_cross_entropy_loss head) as a test: the kernels compiled
with torch.compile(fullgraph=True) against the eager references, a few AdamW steps, losses equal
step by step (the demo raises SystemExit on the first step that differs by more than 1e-4)."""

import importlib.util
import pathlib

DEMO = pathlib.Path(__file__).resolve().parent.parent / "examples" / "moe_demo.py"


def test_language_model_trains_like_the_reference(capsys):
    spec = importlib.util.spec_from_file_location("moe_demo", DEMO)
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    demo.train_language_model()
    printed = capsys.readouterr().out
    assert "losses agree at every step" in printed
    assert len([line for line in printed.splitlines() if line[:1].isdigit()]) == 5  # one row per step
