"""Test-only: with this directory first on PYTHONPATH and EVIDENT_TEST_SLOW_STAGE=<stage>:<seconds> set
(tests/reliability/test_faults.py), every Python process of the run pauses at a stage's most exposed point, so that
the test can kill it there: a stage once its files are written and before its record is, the seal once tracking is
logged and before the manifest is written. Production code has no hook for it."""

import os

SLOW_HOOK = "EVIDENT_TEST_SLOW_STAGE"
_stage, _, _seconds = os.environ.get(SLOW_HOOK, "").partition(":")

if _stage and _seconds:
    import time

    import evident.workflow.core.evidence as _evidence

    def _pause(name: str) -> None:
        print(f"[{name}] {SLOW_HOOK}: pausing {_seconds}s", flush=True)
        time.sleep(float(_seconds))

    _exit = _evidence.Stage.__exit__

    def _paused_exit(self, exc_type, exc, tb):
        if self.primary and exc is None and self.name == _stage:
            _pause(self.name)
        return _exit(self, exc_type, exc, tb)

    _evidence.Stage.__exit__ = _paused_exit
    if _stage == "seal":  # seal imports write_manifest by name, after this has run
        _write_manifest = _evidence.write_manifest

        def _paused_write_manifest(*args, **kwargs):
            _pause("seal")
            return _write_manifest(*args, **kwargs)

        _evidence.write_manifest = _paused_write_manifest
