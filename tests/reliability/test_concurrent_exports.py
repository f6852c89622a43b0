"""Issue 12, class 3: patches and torch.export's tracing state are process-global, so exports in
one process run one at a time (``EXPORT_LOCK``); two exports started in two threads both succeed,
and afterwards every patch target holds its original object."""

import threading

import torch
from models import build, sample_inputs
from transformers import GenerationConfig

from hfexport import PATCHES, DynamoConfig, DynamoExporter, register_pass

STATIC = GenerationConfig(cache_implementation="static", max_cache_len=32)


def patch_targets():
    return {
        # None: a builtin the module only shadows while patched (``module:bytes``)
        (name, id(owner), attribute): getattr(owner, attribute, None)
        for name, patch in PATCHES.items()
        for owner, attribute in patch.owners()
    }


def in_threads(*jobs):
    results, errors = {}, {}

    def run(index, job):
        try:
            results[index] = job()
        except Exception as error:  # kept for the assertion message
            errors[index] = f"{type(error).__name__}: {error}"

    threads = [threading.Thread(target=run, args=(i, job)) for i, job in enumerate(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, errors


def test_two_exports_in_two_threads_both_succeed_and_restore_every_patch():
    before = patch_targets()
    llama, qwen = build("tiny-llama"), build("tiny-qwen3")
    results, errors = in_threads(
        lambda: DynamoExporter().export(llama, sample_inputs(llama), DynamoConfig(dynamic=True)),
        lambda: DynamoExporter().export_for_generation(
            qwen, sample_inputs(qwen, 1, 6), DynamoConfig(dynamic=True), STATIC, multi_token_decode=True
        ),
    )
    assert not errors, errors
    after = patch_targets()
    assert before.keys() == after.keys() and all(after[key] is before[key] for key in before)
    inputs = sample_inputs(llama, 3, 5)
    with torch.no_grad():
        torch.testing.assert_close(results[0].module()(**inputs).logits, llama(**inputs).logits, atol=1e-4, rtol=0)
    assert set(results[1]) == {"prefill", "decode"}


def test_a_failing_export_in_one_thread_leaves_the_other_and_the_patches_intact():
    @register_pass(name="test_concurrent_fails")
    def fails(program):
        raise RuntimeError("boom")

    before = patch_targets()
    model = build("tiny-llama")
    results, errors = in_threads(
        lambda: DynamoExporter().export(model, sample_inputs(model), DynamoConfig(passes=["test_concurrent_fails"])),
        lambda: DynamoExporter().export(model, sample_inputs(model), DynamoConfig(dynamic=True)),
    )
    assert set(results) == {1} and "pass 'test_concurrent_fails' failed (RuntimeError: boom)" in errors[0]
    after = patch_targets()
    assert all(after[key] is before[key] for key in before)
