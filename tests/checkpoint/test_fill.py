"""Reading with several ranges in flight, and through the staging buffers a device load uses (run on the CPU,
forced): same tensors as transformers' load, per-piece sha256 unchanged, buffers reused only after their copy
completed, every parameter and buffer on the device asked, ties kept."""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

import tpkit
from tests.checkpoint.fixtures import hf_logits, logits_of, rel, write_hf
from tpkit.checkpoint import fill, load, pretrained, reader
from tpkit.checkpoint.staging import Staging


@pytest.fixture(autouse=True)
def copied_reads(monkeypatch):
    """These tests are about the reads and the staging: a CPU load copies every byte (no file-mapped views,
    which `test_mapped_weights.py` covers)."""
    monkeypatch.setenv(fill.MAP_ENV, "0")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = write_hf(str(tmp_path_factory.mktemp("hf")), "llama")
    return path, hf_logits(path)


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    """Qwen2 with tied embeddings, and GPT-2 (Conv1D weights stored transposed)."""
    from tests.models.hf import hf_model

    root = tmp_path_factory.mktemp("hf2")
    out = {}
    for name in ("qwen2", "gpt2"):
        hf_model(name).save_pretrained(root / name)
        out[name] = (str(root / name), hf_logits(str(root / name)))
    return out


def test_several_reads_are_in_flight(llama_dir, monkeypatch):
    """Each read is slowed down; with the reader threads several overlap (one thread at a time before)."""
    path, ref = llama_dir
    real, lock, state = reader.pread_scatter, threading.Lock(), {"now": 0, "most": 0}

    def slow(*args):
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
        time.sleep(0.01)
        try:
            return real(*args)
        finally:
            with lock:
                state["now"] -= 1

    monkeypatch.setattr(reader, "pread_scatter", slow)
    monkeypatch.setenv(fill.THREADS_ENV, "4")
    assert rel(logits_of(tpkit.from_pretrained(path)), ref) < 1e-6
    assert state["most"] >= 3, state


def test_a_failing_read_stops_every_thread_and_raises(llama_dir, monkeypatch):
    """One read fails: the error comes out of from_pretrained, and no reader thread is left running."""
    path, _ = llama_dir
    real, calls = reader.pread_scatter, []

    def failing(path_, name, reads):
        calls.append(name)
        if len(calls) == 5:
            raise tpkit.CheckpointError(f"{path_}: truncated file while reading tensor {name!r}")
        return real(path_, name, reads)

    monkeypatch.setattr(reader, "pread_scatter", failing)
    with pytest.raises(tpkit.CheckpointError, match="truncated"):
        tpkit.from_pretrained(path)
    assert not [t for t in threading.enumerate() if t.name.startswith("tpkit-read")]


class FakeEvent:
    """A copy that completes only when waited for: a buffer handed out again before its event was waited on
    would be overwritten while a real DMA still reads it."""

    def __init__(self):
        self.waited = False

    def synchronize(self):
        self.waited = True


class CheckedStaging(Staging):
    """Staging whose copies 'complete' only at synchronize(), recording every buffer reuse."""

    made: list["CheckedStaging"] = []

    def __init__(self, device, chunk_bytes=4096, slots=2):
        super().__init__(device, chunk_bytes, slots)
        self.pending: dict[int, FakeEvent] = {}  # buffer storage -> the event of its last copy
        self.early = 0
        self.most_in_use = 0
        self._made = threading.local()  # the event of this thread's last send
        CheckedStaging.made.append(self)

    def buffer(self):
        buf = super().buffer()
        event = self.pending.get(buf._storage.data_ptr())
        if event is not None and not event.waited:
            self.early += 1
        self.most_in_use = max(self.most_in_use, self.pool.in_use_bytes)
        return buf

    def send(self, buf, nbytes, dst):
        ptr = buf._storage.data_ptr()
        super().send(buf, nbytes, dst)
        self.pending[ptr] = self._made.last

    def record(self):
        self._made.last = FakeEvent()
        return self._made.last


def _use_checked_staging(monkeypatch):
    CheckedStaging.made.clear()
    make = lambda device: CheckedStaging(device)  # noqa: E731
    monkeypatch.setattr(pretrained, "staging_for", make)
    monkeypatch.setattr(load, "staging_for", make)


def _placed(model, device):
    tensors = list(model.parameters()) + list(model.buffers())
    return all(t.device == torch.device(device) for t in tensors)


@pytest.mark.parametrize("world", [1, 3])
def test_staged_from_pretrained_equals_transformers(llama_dir, monkeypatch, world):
    """Forced staging on the CPU: 4 KiB buffers, two of them, so every tensor goes through several reused
    buffers; the loaded shards equal transformers', and no buffer came back before its copy completed."""
    path, ref = llama_dir
    _use_checked_staging(monkeypatch)
    results = tpkit.launch(lambda: (lambda m: (rel(logits_of(m), ref), _placed(m, "cpu")))(
        tpkit.from_pretrained(path, device="cpu")), world, backend="threads")
    assert all(err < 1e-6 and placed for err, placed in results), results
    for s in CheckedStaging.made:
        assert s.copies > 2 and s.early == 0 and s.pool.stats.overflows == 0
        assert s.most_in_use <= s.pool.capacity_bytes and s.pool.stats.hits > 0


def test_staged_dtype_conversion_transposed_weights_and_ties(tied_dir, monkeypatch):
    """GPT-2's Conv1D weights (stored transposed) read as float64 through the staging buffers; Qwen2's tied
    embedding and LM head stay one tensor, on the device asked."""
    _use_checked_staging(monkeypatch)
    path, ref = tied_dir["gpt2"]
    for err in tpkit.launch(lambda: rel(logits_of(tpkit.from_pretrained(path, dtype=torch.float64, device="cpu")),
                                        ref), 2, backend="threads"):
        assert err < 1e-6
    path, ref = tied_dir["qwen2"]

    def body():
        model = tpkit.from_pretrained(path, device="cpu")
        return rel(logits_of(model), ref), model.lm_head.weight is model.model.embed_tokens.weight, \
            _placed(model, "cpu")

    for err, tied, placed in tpkit.launch(body, 2, backend="threads"):
        assert err < 1e-6 and tied and placed
    assert all(s.early == 0 and s.copies > 0 for s in CheckedStaging.made)


def _gloo_staged(path, ref):
    model = tpkit.from_pretrained(path, device="cpu")
    return rel(logits_of(model), ref), _placed(model, "cpu")


def test_staged_from_pretrained_on_gloo(llama_dir, monkeypatch):
    """The same path in real processes (TPKIT_LOAD_STAGING=1 forces it for a CPU load)."""
    path, ref = llama_dir
    monkeypatch.setenv("TPKIT_LOAD_STAGING", "1")
    for err, placed in tpkit.launch(_gloo_staged, 2, backend="gloo", args=(path, ref), timeout=240):
        assert err < 1e-6 and placed


def test_staged_load_sharded_resumes_optimizer_state(tmp_path, monkeypatch):
    """load_sharded through the staging buffers, saved at 2 and loaded at 3, optimizer state included."""
    from tests.models.hf import hf_model

    def save():
        model = tpkit.parallelize(hf_model("llama").double())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(input_ids=torch.ones(1, 4, dtype=torch.long)).logits.sum().backward()
        opt.step()
        tpkit.save_sharded(model, str(tmp_path), optimizer=opt, step=1)
        return ({n: p.detach().clone() for n, p in model.named_parameters()},
                {n: opt.state[p]["exp_avg"].clone() for n, p in model.named_parameters()}, tpkit.shard_layouts(model))

    saved = tpkit.launch(save, 2, backend="threads")
    full = {n: lay.unshard([s[0][n] for s in saved]) for n, lay in saved[0][2].items() if n in saved[0][0]}
    moments = {n: lay.unshard([s[1][n] for s in saved]) for n, lay in saved[0][2].items() if n in saved[0][1]}
    _use_checked_staging(monkeypatch)

    def resume():
        model = tpkit.parallelize(hf_model("llama", initializer_range=0.7).double())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        tpkit.load_sharded(model, str(tmp_path), optimizer=opt)
        lay = tpkit.shard_layouts(model)
        return all(torch.equal(p, lay[n].shard(full[n])) and torch.equal(opt.state[p]["exp_avg"], lay[n].shard(moments[n]))
                   for n, p in model.named_parameters())

    assert all(tpkit.launch(resume, 3, backend="threads"))
    assert CheckedStaging.made and all(s.early == 0 and s.copies > 0 for s in CheckedStaging.made)


@pytest.mark.parametrize("staged", [False, True])
def test_flipped_byte_is_caught_through_either_path(tmp_path, monkeypatch, staged):
    """Per-piece sha256 as before: whole pieces hashed as read (at the saved world size), partial ones from disk
    (at another), through the direct path and through the staging buffers alike."""
    from tests.models.hf import hf_model

    tpkit.launch(lambda: tpkit.save_sharded(tpkit.parallelize(hf_model("llama")), str(tmp_path)), 2,
                 backend="threads")
    f = tmp_path / (tmp_path / "latest").read_text().strip() / "rank-00001.safetensors"
    data = bytearray(f.read_bytes())
    data[-5] ^= 0x40
    f.write_bytes(bytes(data))
    if staged:
        _use_checked_staging(monkeypatch)

    def error():
        try:
            tpkit.from_pretrained(str(tmp_path))
        except tpkit.CheckpointError as exc:
            return str(exc)

    for world in (2, 3):
        for message in tpkit.launch(error, world, backend="threads"):
            assert message and "sha256" in message and "rank-00001" in message, message


def test_staging_waits_for_the_oldest_copy_when_every_buffer_is_taken():
    """Four threads, two buffers: every buffer reuse comes after its copy completed, the pool never grows past
    its capacity, and each destination holds its bytes."""
    staging = CheckedStaging(torch.device("cpu"), chunk_bytes=1024, slots=2)
    dst = torch.zeros(64, 1024, dtype=torch.uint8)

    def work(rows):
        for r in rows:
            buf = staging.buffer()
            buf.view((1024,), torch.uint8).fill_(r % 251)
            staging.send(buf, 1024, dst[r])

    threads = [threading.Thread(target=work, args=(range(i, 64, 4),)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    staging.finish()
    assert staging.early == 0 and staging.pool.stats.overflows == 0 and staging.pool.stats.misses <= 2
    assert all(bool((dst[r] == r % 251).all()) for r in range(64))
    assert os.environ.get("TPKIT_LOAD_STAGING", "0") == "0"


def test_the_default_device_is_the_ranks(monkeypatch):
    """nccl: cuda:LOCAL_RANK modulo the devices (as tpkit.init binds it); gloo and threads: the CPU."""
    from tpkit.checkpoint.staging import load_device

    class Nccl:
        torch_backend = "nccl"

    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert load_device(None, Nccl()) == torch.device("cuda", 1)
    assert load_device("cpu", Nccl()) == torch.device("cpu")

    class Gloo:
        torch_backend = "gloo"

    assert load_device(None, Gloo()) == torch.device("cpu")
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert load_device(None, tpkit.get_communicator()) == torch.device("cpu")  # threads / a world of one
