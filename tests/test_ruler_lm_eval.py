"""benchmarks/ruler_lm_eval.py without lm-eval: what it refuses before starting anything,
and the private NLTK folder that keeps RULER's import off the network."""
import pytest

from benchmarks import ruler_lm_eval as ruler


@pytest.mark.parametrize("args, message", [
    (["--tasks", "niah_single_2"], "needs a data set download"),
    (["--tasks", "ruler_qa_squad"], "needs a data set download"),
    (["--tasks", "niah_single_1,needle_in_a_sock"], "unknown RULER task 'needle_in_a_sock'"),
    (["--limit", "0"], "--limit must be positive"),
    (["--lm-eval", "/nonexistent/lm-eval"], "make ruler"),
])
def test_refuses_what_it_cannot_run(args, message, tmp_path):
    with pytest.raises(SystemExit, match=message):
        ruler.main([*args, "--out", str(tmp_path)])
    assert not any(tmp_path.iterdir())  # refused before writing anything


def test_offline_env_has_punkt_tab_and_hub_access_off(tmp_path):
    env = ruler.offline_env(tmp_path)
    assert env["HF_HUB_OFFLINE"] == env["HF_DATASETS_OFFLINE"] == env["TRANSFORMERS_OFFLINE"] == "1"
    # nltk.data.find("tokenizers/punkt_tab"), which RULER's prepare_niah calls at import
    # (downloading on a miss), looks for this folder under NLTK_DATA
    assert (tmp_path / "nltk_data" / "tokenizers" / "punkt_tab").is_dir()
    assert env["NLTK_DATA"] == str(tmp_path / "nltk_data")
