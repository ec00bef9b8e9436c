"""olmo3/atomic.py: a file is replaced whole or left as it was, and no temporary is left behind."""
import os
import stat

import numpy as np
import pytest

from olmo3 import atomic


def test_replacing_renames_a_whole_file_with_the_umask_permissions(tmp_path):
    path = tmp_path / "sub" / "out.json"          # the directory is made
    old = os.umask(0o022)
    try:
        atomic.write_json(path, {"a": 1}, indent=1)
    finally:
        os.umask(old)
    assert path.read_text() == '{\n "a": 1\n}\n'   # json.dump's indent=1, and a trailing newline
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644   # not mkstemp's 0600
    assert os.listdir(path.parent) == ["out.json"]
    atomic.write_text(path, "second\n")           # over an existing file
    assert path.read_text() == "second\n" and os.listdir(path.parent) == ["out.json"]


def test_a_new_directory_is_renamed_whole_and_readable_as_mkdir_makes_it(tmp_path):
    """checkpoint.new_directory (converted checkpoints): filled under a temporary sibling, renamed
    into place, and as readable as a directory mkdir makes (the temporary of mkdtemp is 0700)."""
    from olmo3.checkpoint import new_directory
    old = os.umask(0o022)
    try:
        with new_directory(tmp_path / "ckpt") as tmp:
            assert os.path.dirname(tmp) == str(tmp_path) and os.path.basename(tmp).startswith(".")
            (tmp_path / os.path.basename(tmp) / "weights").write_text("w")
        os.mkdir(tmp_path / "made")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "ckpt").st_mode) == stat.S_IMODE(os.stat(tmp_path / "made").st_mode) == 0o755
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "made"] and (tmp_path / "ckpt" / "weights").read_text() == "w"


def test_a_new_directory_follows_a_symlink_and_removes_what_a_killed_writer_left(tmp_path):
    """new_directory at a symlink (SFT / DPO --out_dir, convert.py --to) wrote everything, then
    failed to rename onto the link with a bare errno; it now fills where the link points, a dangling
    link included. A writer killed by SIGKILL left its temporary for good (tens of GB for a 7B
    conversion): the next writer of the same path on this host removes it, never a live one's."""
    import signal
    import socket
    import subprocess
    import sys
    from olmo3.checkpoint import new_directory
    (tmp_path / "target").mkdir()
    os.symlink(tmp_path / "target", tmp_path / "link")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    for link, target in (("link", "target"), ("dangling", "nowhere")):
        with new_directory(tmp_path / link) as tmp:
            (tmp_path / os.path.basename(tmp) / "f").write_text(link)
        assert os.path.islink(tmp_path / link) and (tmp_path / target / "f").read_text() == link
    out = tmp_path / "out"
    killed = subprocess.Popen([sys.executable, "-c", "import os, sys, time\nfrom olmo3.checkpoint import new_directory\n"
                               "with new_directory(sys.argv[1]) as tmp:\n    open(os.path.join(tmp, 'part'), 'w')"
                               ".write('x')\n    print(tmp, flush=True)\n    time.sleep(600)", str(out)],
                              stdout=subprocess.PIPE, text=True)
    left = killed.stdout.readline().strip()
    from olmo3.checkpoint import _this_host
    alive = tmp_path / f".tmp-out-{os.getpid()}@{_this_host()}-live1234"   # this process: running
    elsewhere = tmp_path / f".tmp-out-{killed.pid}@not-{_this_host()}-abcd_123"   # another host's
    other_ns = tmp_path / f".tmp-out-{killed.pid}@{socket.gethostname()}~1-abcd_123"   # another PID namespace's
    for d in (alive, elsewhere, other_ns):
        d.mkdir()
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert os.path.isdir(left) and os.path.basename(left).startswith(f".tmp-out-{killed.pid}@")
    with new_directory(out) as tmp:
        assert not os.path.exists(left) and alive.is_dir() and elsewhere.is_dir() and other_ns.is_dir()
    assert sorted(os.listdir(tmp_path)) == sorted(["target", "link", "dangling", "nowhere", "out", alive.name,
                                                  elsewhere.name, other_ns.name])


def test_a_new_directory_another_process_filled_meanwhile_is_said_and_kept(tmp_path):
    """Two writers of one new directory: the second to finish ended in a traceback (Directory not
    empty, exit 1, retried). The first one's output stays; the second's is removed and said."""
    from olmo3.checkpoint import new_directory
    out = tmp_path / "out"
    with pytest.raises(FileExistsError, match=r"was filled by another process while this one wrote its SFT data, "
                                              r"which was removed; choose a new directory"):
        with new_directory(out, "SFT data") as tmp:
            (tmp_path / os.path.basename(tmp) / "mine").write_text("2")
            out.mkdir()
            (out / "theirs").write_text("1")
    assert os.listdir(tmp_path) == ["out"] and os.listdir(out) == ["theirs"]


def test_an_error_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "out.txt"
    path.write_text("old")
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic.replacing(path) as tmp:
            assert os.path.dirname(tmp) == str(tmp_path) and os.path.basename(tmp).startswith(".")
            with open(tmp, "w") as f:
                f.write("half of the new")
            raise RuntimeError("disk full")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["out.txt"]


def test_the_data_is_fsynced_before_the_rename(tmp_path, monkeypatch):
    """A machine crash right after the rename must not leave an empty file under the target's name:
    the temporary's data reaches the disk (fsync of that file) before it is renamed."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(("fsync", os.fstat(fd).st_ino)) or real_fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b: events.append(("replace", os.stat(a).st_ino)) or real_replace(a, b))
    path = tmp_path / "out.txt"
    atomic.write_text(path, "data")
    inode = os.stat(path).st_ino
    assert events == [("fsync", inode), ("replace", inode)]


def test_suffix_keeps_np_savez_on_the_temporary_name(tmp_path):
    path = tmp_path / "cache.npz"
    with atomic.replacing(path, suffix=".npz") as tmp:
        assert tmp.endswith(".npz")
        np.savez(tmp, x=np.arange(3))            # would write tmp + ".npz" without the suffix
    with np.load(path) as z:
        np.testing.assert_array_equal(z["x"], np.arange(3))
    assert os.listdir(tmp_path) == ["cache.npz"]


def test_two_writers_of_one_file_get_distinct_temporaries(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "getpid", lambda: 1)  # containers on two hosts: both writers are pid 1
    path = tmp_path / "shared.txt"
    with atomic.replacing(path) as a, atomic.replacing(path) as b:
        assert a != b
        for t, text in ((a, "from a"), (b, "from b")):
            with open(t, "w") as f:
                f.write(text)
    assert path.read_text() == "from a"           # the last rename wins, with a whole file
    assert os.listdir(tmp_path) == ["shared.txt"]


def test_write_pairs_leaves_nothing_on_a_bad_pair(tmp_path):
    from data import preference
    good = (([1, 2, 3], [False, True, True]), ([1, 2, 4], [False, True, True]))
    bad = (([1, 2, 3], [False, True]), ([1, 2, 4], [False, True, True]))   # mask shorter than tokens
    out = tmp_path / "pairs"
    manifest = preference.write_pairs(out, [good], max_seq_length=8)
    before = {n: (out / n).read_bytes() for n in os.listdir(out)}
    assert manifest["pairs"] == 1 and not [n for n in before if n.startswith(".")]
    with pytest.raises(ValueError, match=r"^pair 2, chosen: token ids \(3,\) and label mask \(2,\) must be 1-D of one"):
        preference.write_pairs(out, [good, bad], max_seq_length=8)
    assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before   # the old data set, whole


def test_check_directory_probes_where_the_run_directory_will_be_and_leaves_nothing(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    atomic.check_directory(tmp_path, "--run_dir")                     # an existing directory
    atomic.check_directory(tmp_path / "new" / "run", "--run_dir")     # probed in tmp_path, not made
    assert os.listdir(tmp_path) == ["keep.txt"]
    with pytest.raises(atomic.UserError, match=r"^--run_dir='.*keep.txt/run': .*keep.txt is a file, not a directory"):
        atomic.check_directory(tmp_path / "keep.txt" / "run", "--run_dir")


def test_check_directory_names_the_mount_fix_when_directories_cannot_be_renamed(tmp_path, monkeypatch):
    """A Cloud Storage FUSE mount of a flat bucket refuses directory renames by default
    (rename-dir-limit 0); Orbax's and new_directory's checkpoints need them."""
    def refuse(src, dst):
        raise OSError(38, "Function not implemented")
    monkeypatch.setattr(os, "rename", refuse)
    with pytest.raises(atomic.UserError) as e:
        atomic.check_directory(tmp_path / "run", "--to", given="orbax:" + str(tmp_path / "run"))
    line = str(e.value)
    assert line.startswith(f"--to='orbax:{tmp_path / 'run'}': cannot rename a directory in {tmp_path} "
                           "(Function not implemented); checkpoints are written into a temporary directory")
    assert "hierarchical namespace" in line and "rename-dir-limit=" in line and "\n" not in line
    assert os.listdir(tmp_path) == []                                  # the probe is gone


def test_check_directory_reads_the_probe_back_and_names_the_step_that_failed(tmp_path, monkeypatch):
    """A rename that leaves the file's bytes behind (the directory arrives, its file empty) is a
    rename that does not work; a file that cannot be written is said as that, without the mount's
    rename advice."""
    import builtins

    def hollow_rename(src, dst):
        os.mkdir(dst)
        open(os.path.join(dst, "probe"), "w").close()
    with monkeypatch.context() as m:
        m.setattr(os, "rename", hollow_rename)
        with pytest.raises(atomic.UserError, match=r"cannot rename a directory in .*does not read back.*rename-dir-limit"):
            atomic.check_directory(tmp_path / "run", "--run_dir")
    assert os.listdir(tmp_path) == []

    def full_disk(path, mode="r", *args, **kwargs):
        if "w" in mode and os.path.basename(path) == "probe":
            raise OSError(28, "No space left on device")
        return builtins.open(path, mode, *args, **kwargs)
    monkeypatch.setattr(atomic, "open", full_disk, raising=False)
    with pytest.raises(atomic.UserError, match=r"cannot write a file in .*\(No space left on device\); give a "
                                               "directory this process can write$"):
        atomic.check_directory(tmp_path / "run", "--run_dir")
    assert os.listdir(tmp_path) == []


def test_check_writable_needs_files_only(tmp_path, monkeypatch):
    """eval.py's --out holds files (each written and renamed whole), never a renamed directory:
    a mount that refuses directory renames is fine for it; one where nothing can be written is
    refused by name, and the probe leaves nothing."""
    def refuse(src, dst):
        raise OSError(38, "Function not implemented")
    monkeypatch.setattr(os, "rename", refuse)
    atomic.check_writable(tmp_path / "report", "--out")
    assert os.listdir(tmp_path) == []
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(atomic.UserError, match=r"^--out='.*keep.txt/report': .*keep.txt is a file, not a directory"):
        atomic.check_writable(tmp_path / "keep.txt" / "report", "--out")
    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(atomic.UserError, match=f"^--out='{tmp_path / 'report'}': cannot write a file in {tmp_path} "
                                               r"\(Function not implemented\); give a directory this process can write"):
        atomic.check_writable(tmp_path / "report", "--out")
    assert os.listdir(tmp_path) == ["keep.txt"]


def tpu_jobset_spec() -> dict:
    """launch/tpu_jobset.yaml's JobSet spec."""
    yaml = pytest.importorskip("yaml")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "launch", "tpu_jobset.yaml")) as f:
        return yaml.safe_load(f)["spec"]


def test_tpu_jobset_mount_renames_directories():
    """launch/tpu_jobset.yaml's run directory sits on its Cloud Storage FUSE volume, mounted with
    the rename-dir-limit that atomic.check_directory's advice names (a flat bucket refuses
    directory renames without it)."""
    pod = tpu_jobset_spec()["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    train = pod["containers"][0]
    run_dir = next(a.split("=", 1)[1] for a in train["command"] if a.startswith("--run_dir="))
    mount = next(m for m in train["volumeMounts"] if run_dir.startswith(m["mountPath"] + "/"))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["csi"]["driver"] == "gcsfuse.csi.storage.gke.io"
    options = volume["csi"]["volumeAttributes"]["mountOptions"].split(",")
    limit = next(o for o in options if o.startswith("rename-dir-limit="))
    assert limit in atomic.RENAME_ADVICE


def test_tpu_jobset_never_restarts_what_the_launcher_never_reruns():
    """launch/tpu_jobset.yaml ends the JobSet, instead of restarting every pod, on exactly the exit
    statuses that --resume_until_done never reruns (olmo3/launch.py NON_RETRYABLE: 2, a user's
    error; 3, a non-finite state that a restart would resume into again)."""
    from olmo3.launch import NON_RETRYABLE
    spec = tpu_jobset_spec()
    assert {"action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]} in spec["failurePolicy"]["rules"]
    job = spec["replicatedJobs"][0]["template"]["spec"]
    final = [r["onExitCodes"] for r in job["podFailurePolicy"]["rules"] if r["action"] == "FailJob"]
    assert [(f["containerName"], f["operator"], set(f["values"])) for f in final] == [("train", "In", set(NON_RETRYABLE))]


def test_an_interrupted_new_directory_leaves_nothing(tmp_path):
    """Ctrl-C or SIGTERM (KeyboardInterrupt, SystemExit) while a converted checkpoint is written:
    the temporary sibling goes too (a 7B conversion's is tens of GB), as on any error."""
    from olmo3.checkpoint import new_directory
    for stop in (KeyboardInterrupt, SystemExit):
        with pytest.raises(stop):
            with new_directory(tmp_path / "out") as tmp:
                with open(os.path.join(tmp, "f"), "w") as f:
                    f.write("x")
                raise stop()
        assert os.listdir(tmp_path) == []
