"""Issue 22, options: loadFromFile and PopTorch's ConfigFileError, copying Options, every
TensorLocations setter, and the error for an unknown option."""
import copy
import re

import pytest
import torch
from torch.testing import assert_close

import pipetorch as poptorch
from helpers.models import TinyMLP, data


def write(tmp_path, text):
    path = tmp_path / "poptorch.conf"
    path.write_text(text)
    return path


def test_options_from_a_file_train_like_plain_pytorch(tmp_path):
    path = write(tmp_path, "# run settings\ndeviceIterations(2)\n\n"
                           "Training.gradientAccumulation(2)\noutputMode(poptorch.OutputMode.All)\n")
    opts = poptorch.Options().loadFromFile(path)
    assert (opts.device_iterations, opts.Training.gradient_accumulation) == (2, 2)
    torch.manual_seed(0)
    model = TinyMLP()
    plain = copy.deepcopy(model)
    wrapper = poptorch.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    x, labels = data(8)
    got = wrapper(x, labels)[1]
    want = []
    for step in range(2):
        optimizer.zero_grad()
        for micro in range(2):
            rows = slice((2 * step + micro) * 2, (2 * step + micro + 1) * 2)
            loss = plain(x[rows], labels[rows])[1]
            (loss / 2).backward()
            want.append(loss.detach())
        optimizer.step()
    assert_close(got.as_subclass(torch.Tensor), torch.stack(want))
    wrapper.destroy()
    assert_close(model.fc1.weight, plain.fc1.weight)


def test_a_syntax_error_in_the_file_is_poptorchs_config_file_error(tmp_path):
    path = write(tmp_path, "deviceIterations(4)\nreplicationFactor(2\n")
    opts = poptorch.Options()
    with pytest.raises(poptorch.ConfigFileError,
                       match=re.escape("SyntaxError at line 2 of poptorch.conf: '(' was never "
                                       "closed\n> replicationFactor(2")) as info:
        opts.loadFromFile(path)
    assert isinstance(info.value, poptorch.Error)
    assert opts.device_iterations == 1  # nothing applied


def test_config_file_error_is_also_found_in_the_options_module():
    # PopTorch scripts catch it as poptorch.options.ConfigFileError.
    import pipetorch.options
    assert pipetorch.options.ConfigFileError is poptorch.ConfigFileError


def test_an_unknown_option_in_the_file_names_file_line_and_valid_options(tmp_path):
    path = write(tmp_path, "deviceIterations(4)\ndeviceIteration(3)\n")
    with pytest.raises(poptorch.ConfigFileError,
                       match=re.escape(f"{path}, line 2: 'deviceIteration(3)': ") + ".*"
                       "no option .deviceIteration.; valid: .*deviceIterations"):
        poptorch.Options().loadFromFile(path)


@pytest.mark.parametrize("copier", [copy.copy, copy.deepcopy, poptorch.Options.clone],
                         ids=["copy", "deepcopy", "clone"])
def test_a_copy_of_options_is_independent_and_editable(copier):
    opts = poptorch.Options().deviceIterations(3)
    opts.Training.gradientAccumulation(2)
    poptorch.inferenceModel(TinyMLP(), poptorch.Options())  # unrelated: nothing shared
    poptorch.DataLoader(opts, torch.utils.data.TensorDataset(torch.zeros(12, 1)))  # freezes opts
    copied = copier(opts)
    assert (copied.device_iterations, copied.Training.gradient_accumulation) == (3, 2)
    copied.deviceIterations(5).Training.gradientAccumulation(4)
    assert (opts.device_iterations, opts.Training.gradient_accumulation) == (3, 2)
    with pytest.raises(AttributeError, match="Can't modify frozen Options"):
        opts.deviceIterations(4)


@pytest.mark.parametrize("setter", ["setActivationLocation", "setWeightLocation",
                                    "setOptimizerLocation", "setAccumulatorLocation"])
def test_every_tensor_locations_setter(setter):
    settings = (poptorch.TensorLocationSettings().useOnChipStorage(True)
                .minElementsForOffChip(16).useReplicatedTensorSharding(False)
                .minElementsForReplicatedTensorSharding(4).useIOTilesToLoad(False)
                .useIOTilesToStore(False))
    opts = poptorch.Options()
    assert getattr(opts.TensorLocations, setter)(settings) is opts.TensorLocations
    key = re.sub(r"(?<!^)(?=[A-Z])", "_", setter[3:]).lower()  # activation_location, ...
    stored = opts.TensorLocations.toDict()[key]
    assert stored["use_on_chip_storage"] is True and stored["min_elements_for_off_chip"] == 16
    assert opts.TensorLocations.numIOTiles(32) is opts.TensorLocations
    with pytest.raises((TypeError, ValueError)):
        getattr(opts.TensorLocations, setter)({"useOnChipStorage": True})


def test_an_unknown_option_names_the_valid_ones():
    opts = poptorch.Options()
    with pytest.raises(AttributeError, match=r"no option 'deviceIteration'.*Did you mean "
                                             r"deviceIterations.*Valid setters:"):
        opts.deviceIteration(3)
    with pytest.raises(AttributeError, match=r"Cannot assign Options.device_iterations"):
        opts.device_iterations = 3
    with pytest.raises(AttributeError, match=r"Options.Training has no option 'gradAccum'"):
        opts.Training.gradAccum(2)
