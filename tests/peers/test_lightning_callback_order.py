"""The order of callback hooks in a fit (lightning tests/tests_pytorch/models/test_hooks.py::
test_trainer_model_hook_system_fit), ported: Lightning's expected sequence for 2 training
batches and validation at the epoch's end, mapped onto lightlike's events. Hooks with no
lightlike counterpart (setup/teardown, the sanity check, backward and zero_grad hooks, the
validation batch hooks' start half) are left out of both sides."""

from __future__ import annotations

import pytest
from peers_common import BoringModel, RandomDataset, boring_fitter

import lightlike as ll

EVENTS = ("on_fit_start", "on_fit_end", "on_epoch_start", "on_epoch_end", "on_step_start", "on_step_end",
          "on_before_optimizer_step", "on_evaluate", "on_save", "on_eval_batch_end")

# Lightning's Callback hooks in test_trainer_model_hook_system_fit's expected order, with the
# lightlike event each corresponds to (None: no counterpart)
LIGHTNING_TO_LIGHTLIKE = {
    "on_fit_start": "on_fit_start", "on_sanity_check_start": None, "on_sanity_check_end": None,
    "on_train_start": None, "on_train_epoch_start": "on_epoch_start", "on_train_batch_start": "on_step_start",
    "on_before_backward": None, "on_after_backward": None, "on_before_optimizer_step": "on_before_optimizer_step",
    "on_before_zero_grad": None, "on_train_batch_end": "on_step_end", "on_validation_start": None,
    "on_validation_epoch_start": None, "on_validation_batch_start": None,
    "on_validation_batch_end": "on_eval_batch_end", "on_validation_epoch_end": None,
    "on_validation_end": "on_evaluate", "on_train_epoch_end": "on_epoch_end", "on_save_checkpoint": "on_save",
    "on_train_end": None, "on_fit_end": "on_fit_end",
}


def lightning_expected(train_batches, val_batches):
    """``test_trainer_model_hook_system_fit``'s ``Callback.*`` entries after the sanity check."""
    batch = ["on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
             "on_before_zero_grad", "on_train_batch_end"]
    val = ["on_validation_start", "on_validation_epoch_start",
           *(["on_validation_batch_start", "on_validation_batch_end"] * val_batches),
           "on_validation_epoch_end", "on_validation_end"]
    return ["on_fit_start", "on_train_start", "on_train_epoch_start", *(batch * train_batches), *val,
            "on_train_epoch_end", "on_save_checkpoint", "on_train_end", "on_fit_end"]


class Recorder(ll.Callback):
    def __init__(self, name, calls):
        self.name, self.calls = name, calls


for _event in EVENTS:
    setattr(Recorder, _event, (lambda e: lambda self, *args: self.calls.append((self.name, e)))(_event))


@pytest.mark.parametrize(("train_batches", "val_batches"), [(2, 2), (1, 3)])
def test_trainer_model_hook_system_fit(tmp_path, train_batches, val_batches):
    """lightning tests/tests_pytorch/models/test_hooks.py::test_trainer_model_hook_system_fit (the
    callback's hooks; one epoch, validation and a checkpoint at its end)."""
    calls = []
    fitter = boring_fitter(tmp_path, callbacks=[Recorder("a", calls)], max_epochs=1, eval_on_epoch_end=True,
                           save_strategy="epoch", eval_batch_size=1, log_every=10)
    fitter.fit(BoringModel(), RandomDataset(32, train_batches), RandomDataset(32, val_batches, seed=1))
    mapped = [LIGHTNING_TO_LIGHTLIKE[h] for h in lightning_expected(train_batches, val_batches)]
    assert [e for _, e in calls] == [e for e in mapped if e is not None]


def test_callbacks_called_in_the_order_given(tmp_path):
    """lightning tests/tests_pytorch/trainer/connectors/test_callback_connector.py (callbacks run in
    the order passed): every event reaches the callbacks in list order."""
    calls = []
    fitter = boring_fitter(tmp_path, callbacks=[Recorder("first", calls), Recorder("second", calls)], max_epochs=1,
                           eval_on_epoch_end=True, save_strategy="epoch", eval_batch_size=1)
    fitter.fit(BoringModel(), RandomDataset(32, 2), RandomDataset(32, 1, seed=1))
    assert [name for name, _ in calls] == ["first", "second"] * (len(calls) // 2)
    assert [e for _, e in calls[::2]] == [e for _, e in calls[1::2]]
