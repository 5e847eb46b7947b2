"""torch.save of a wrapper saves the user's model; poptorch.load of a file that is not an
executable (a torch.save file, a truncated one, none) says what it expected."""
from __future__ import annotations

import io
import pickle

import pytest
import torch

import pipetorch as poptorch
from error_cases import Regressor
from pipetorch.runtime.artefact import ExecutableError

WRITE = "write one with wrapper.compileAndExport(path, *inputs) or wrapper.save(path)"


# Issue 23: torch.save(wrapper) failed with "args[0] from __newobj__ args has the wrong class".
@pytest.mark.parametrize("trained", [False, True])
def test_torch_save_of_a_wrapper_saves_the_users_model_with_its_latest_weights(trained):
    torch.manual_seed(0)
    model = Regressor()
    wrapper = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    if trained:
        wrapper(torch.randn(4, 4), torch.randn(4, 1))
    buffer = io.BytesIO()
    torch.save(wrapper, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert type(loaded) is Regressor and not isinstance(loaded, poptorch.PoplarExecutor)
    for name, value in model.state_dict().items():  # the weights after the training step
        torch.testing.assert_close(loaded.state_dict()[name], value, msg=name)
    x = torch.randn(3, 4)
    torch.testing.assert_close(loaded(x), model(x))
    wrapper(torch.randn(4, 4), torch.randn(4, 1))  # saving left the wrapper usable
    assert type(pickle.loads(pickle.dumps(wrapper))) is Regressor
    wrapper.destroy()


def test_loading_a_torch_save_file_says_to_use_torch_load(tmp_path):
    path = tmp_path / "model.pt"
    torch.save(Regressor(), path)
    with pytest.raises(ExecutableError) as info:
        poptorch.load(str(path))
    assert str(info.value) == (
        f"poptorch.load: {str(path)!r} is not a pipetorch executable (those start with "
        "'PIPETORCH-EXECUTABLE'); it is a torch.save file (a zip archive): load it with "
        f"torch.load(path). To make an executable, {WRITE}")


def test_loading_a_truncated_executable_says_so(tmp_path):
    path = tmp_path / "model.pex"
    poptorch.inferenceModel(Regressor()).compileAndExport(str(path), torch.randn(2, 4))
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(ExecutableError) as info:
        poptorch.load(str(path))
    assert str(info.value).startswith(f"poptorch.load: the executable {str(path)!r} is "
                                      "truncated or damaged (")
    assert str(info.value).endswith(f"): {WRITE} again")


def test_loading_a_missing_or_foreign_file(tmp_path):
    with pytest.raises(ExecutableError, match=r"^poptorch.load: there is no file '\S*nothing.pex' "
                                              r"\(expected a pipetorch executable; write one"):
        poptorch.load(str(tmp_path / "nothing.pex"))
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ExecutableError, match=r"it is a file starting with b'hello'. To make an "
                                              r"executable, write one"):
        poptorch.load(str(tmp_path / "notes.txt"))
