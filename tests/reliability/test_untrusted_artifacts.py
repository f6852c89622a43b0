"""Issue 12, class 4: loading an artifact never runs code from it unless the user opts in.

``torch.export.load`` unpickles a ``.pt2``'s sample inputs and falls back to full unpickling when
``weights_only`` loading fails; a crafted file then runs its code. hfexport loads with
``weights_only`` only and refuses the rest with :class:`ArtifactError`, through the API and the
``replay`` and ``generate`` commands, unless ``trust=True`` / ``--trust-artifact``."""

import io
import os
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch
from models import build

from hfexport import ArtifactError, load_exported_program
from hfexport.generation import greedy_decode
from hfexport.targets.dynamo import DynamoDecoder

HFEXPORT = [sys.executable, "-m", "hfexport.cli"]


class CreatesAFile:
    """A pickle payload: unpickling it runs ``touch <path>``."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def crafted(program_path, out_path, marker):
    """A copy of a real ``.pt2`` whose sample inputs are a pickle that creates ``marker``."""
    with zipfile.ZipFile(program_path) as source, zipfile.ZipFile(out_path, "w") as target:
        for item in source.infolist():
            data = source.read(item.filename)
            if item.filename.endswith("sample_inputs/model.pt"):
                buffer = io.BytesIO()
                torch.save({"inputs": CreatesAFile(marker)}, buffer)
                data = buffer.getvalue()
            target.writestr(item, data)
    return out_path


@pytest.fixture(scope="module")
def decode_export(tmp_path_factory):
    """``hfexport export tiny-llama --generation`` (dynamo, decode only): the folder."""
    out = tmp_path_factory.mktemp("export") / "gen"
    command = [*HFEXPORT, "export", "tiny-llama", "--generation", "--components", "decode", "--max-cache-len", "32"]
    result = subprocess.run([*command, "--out", str(out)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def run_cli(*args):
    return subprocess.run([*HFEXPORT, *map(str, args)], capture_output=True, text=True)


def assert_one_line_error(result, *words):
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert lines[-1].startswith("hfexport: error: ") and all(w in lines[-1] for w in words), lines[-1]


def test_hfexports_own_static_cache_decode_program_loads_safely_and_decodes(decode_export):
    program = load_exported_program(decode_export / "decode.pt2")
    model = build("tiny-llama")
    prompt = torch.tensor([[5, 9, 14, 2, 77]])
    decoder = DynamoDecoder(program, batch_size=1)
    tokens = greedy_decode(decoder, prompt, 8, decoder.max_cache_len)
    with torch.no_grad():
        expected = model.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert torch.equal(tokens, expected)


def test_a_crafted_program_is_refused_by_load_exported_program(decode_export, tmp_path):
    marker = tmp_path / "created"
    evil = crafted(decode_export / "decode.pt2", tmp_path / "evil.pt2", marker)
    with pytest.raises(ArtifactError, match=r"pickled Python objects \(posix.system\).*trust=True"):
        load_exported_program(evil)
    assert not marker.exists()
    # the variable that forces weights_only loading is only set during the load
    assert "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ


def test_trust_opts_in_to_full_unpickling(decode_export, tmp_path):
    marker = tmp_path / "created"
    evil = crafted(decode_export / "decode.pt2", tmp_path / "evil.pt2", marker)
    load_exported_program(evil, trust=True)
    assert marker.exists()  # what trust=True means: the file's code ran


def test_a_crafted_program_is_refused_by_replay_and_generate(decode_export, tmp_path):
    marker = tmp_path / "created"
    evil = crafted(decode_export / "decode.pt2", tmp_path / "evil.pt2", marker)
    assert_one_line_error(
        run_cli("replay", evil, "--passes", "dead_code_elimination"), "posix.system", "--trust-artifact"
    )
    folder = tmp_path / "gen"
    shutil.copytree(decode_export, folder)
    shutil.copy(evil, folder / "decode.pt2")
    assert_one_line_error(run_cli("generate", folder, "--prompt-ids", "5,9"), "posix.system", "--trust-artifact")
    assert not marker.exists()


def test_a_truncated_program_is_a_clear_error(decode_export, tmp_path):
    truncated = tmp_path / "truncated.pt2"
    truncated.write_bytes((decode_export / "decode.pt2").read_bytes()[:4096])
    with pytest.raises(ArtifactError, match="not a readable torch.export archive.*truncated"):
        load_exported_program(truncated)
    with pytest.raises(ArtifactError, match="does not exist"):
        load_exported_program(tmp_path / "missing.pt2")
    assert_one_line_error(run_cli("replay", truncated, "--passes", "dead_code_elimination"), "truncated")
