"""Native kernels are built once however many processes start together: the others wait for it, with a deadline."""

import shutil
import threading

import pytest

from ringsched.kernels import native_build

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")


FLAGS, LINK = ["-fPIC", "-c"], ["-shared"]


def source(tmp_path):
    src = tmp_path / "k.c"
    src.write_text("int answer(void) { return 42; }\n")
    return src


def test_stages_starting_together_build_once(tmp_path, monkeypatch):
    monkeypatch.setenv("RINGSCHED_CACHE", str(tmp_path / "cache"))
    builds, compile_ = [], native_build._compile
    monkeypatch.setattr(native_build, "_compile", lambda *a: (builds.append(a), compile_(*a)))
    got, src = [], source(tmp_path)
    threads = [threading.Thread(target=lambda: got.append(native_build.build(src, FLAGS, LINK))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(builds) == 1 and len(got) == 4 and len(set(got)) == 1 and got[0].exists()


def test_a_build_held_too_long_elsewhere_is_an_error_naming_the_library(tmp_path, monkeypatch):
    monkeypatch.setenv("RINGSCHED_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(native_build, "LOCK_WAIT", 0.3)
    monkeypatch.setattr(native_build, "_compile", lambda *a: pytest.fail("built while another process held the lock"))
    held = threading.Event()
    release = threading.Event()
    real_wait = native_build._wait_for

    src = source(tmp_path)

    def holder():  # another process's build that does not finish
        lib = native_build.target(src, FLAGS, LINK)
        lib.parent.mkdir(parents=True)
        with open(lib.with_name(f".{lib.stem}.lock"), "w") as lock:
            real_wait(lock, lib)
            held.set()
            release.wait(30)

    t = threading.Thread(target=holder)
    t.start()
    assert held.wait(30)
    try:
        with pytest.raises(RuntimeError, match=r"another process has been building k-[0-9a-f]+\.so"):
            native_build.build(src, FLAGS, LINK)
    finally:
        release.set()
        t.join(30)
