"""File formats without TensorFlow: MNIST idx and TFRecord files, local and in memory (fsspec),
by name, glob or list; corrupt files raise errors naming the file, the record and the values."""

import gzip
import json
import struct

import fsspec
import google_crc32c
import numpy as np
import pytest

import estimax as ex
from estimax import cli
from estimax.data import feed, files, idx, tfrecord


def _idx_bytes(array: np.ndarray, magic: int) -> bytes:
    header = struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


def write_mnist(directory, split, n, seed=0, gz=False, fs_prefix="", sep="-"):
    """Small MNIST-like idx files: digit k is a bright square at a position given by k."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, n).astype(np.uint8)
    images = rng.integers(0, 40, (n, 28, 28)).astype(np.uint8)
    for i, k in enumerate(labels):
        r, c = divmod(int(k), 5)
        images[i, 4 + 10 * r : 12 + 10 * r, 1 + 5 * c : 5 + 5 * c] = 255
    for kind, array, magic in (("images", images, 2051), ("labels", labels, 2049)):
        name = f"{fs_prefix}{directory}/{split}-{kind}{sep}idx{3 if kind == 'images' else 1}-ubyte" + (
            ".gz" if gz else ""
        )
        data = _idx_bytes(array, magic)
        with fsspec.open(name, "wb") as f:
            f.write(gzip.compress(data) if gz else data)
    return images, labels


@pytest.mark.parametrize("gz, fs_prefix", [(False, ""), (True, ""), (False, "memory://")])
def test_mnist_idx_files_read_back(tmp_path, gz, fs_prefix):
    directory = "/mnist-test" if fs_prefix else str(tmp_path)
    images, labels = write_mnist(directory, "train", 50, gz=gz, fs_prefix=fs_prefix)
    data = idx.mnist(fs_prefix + directory, "train")
    assert len(data) == 50
    np.testing.assert_array_equal(data.features["image"], images.astype(np.float32) / 255)
    np.testing.assert_array_equal(data.labels, labels)


def test_idx_headers_are_validated(tmp_path):
    images = np.zeros((5, 28, 28), np.uint8)
    bad_magic = tmp_path / "a-images-idx3-ubyte"
    bad_magic.write_bytes(_idx_bytes(images, 2049))
    with pytest.raises(ValueError, match=rf"{bad_magic}: magic number 2049; expected 2051"):
        idx.read_idx(bad_magic, idx.IMAGES_MAGIC)
    short = tmp_path / "b-images-idx3-ubyte"
    short.write_bytes(_idx_bytes(images, 2051)[:-10])
    with pytest.raises(ValueError, match=rf"{short}: 3926 bytes; expected 3936 \(a 16-byte header and 5 x 28 x 28"):
        idx.read_idx(short, idx.IMAGES_MAGIC)
    (tmp_path / "train-images-idx3-ubyte").write_bytes(_idx_bytes(images, 2051))
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(_idx_bytes(np.zeros(4), 2049))
    with pytest.raises(ValueError, match=r"train-labels-idx1-ubyte: 4 labels; expected 5, one per image"):
        idx.mnist(tmp_path)
    with pytest.raises(
        FileNotFoundError,
        match=r"No MNIST t10k images in .*: looked for t10k-images-idx3-ubyte, t10k-images-idx3-ubyte.gz, "
        r"t10k-images.idx3-ubyte, t10k-images.idx3-ubyte.gz; the directory holds a-images-idx3-ubyte, "
        r"b-images-idx3-ubyte, train-images-idx3-ubyte, train-labels-idx1-ubyte\.",
    ):
        idx.mnist(tmp_path, "t10k")
    with pytest.raises(FileNotFoundError, match=r"'.*/absent' is not a directory; expected the directory"):
        idx.mnist(tmp_path / "absent")


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_files_named_with_a_dot_before_idx_are_found(tmp_path, gz):
    images, labels = write_mnist(tmp_path, "train", 20, gz=gz, sep=".")
    data = idx.mnist(tmp_path, "train")
    np.testing.assert_array_equal(data.labels, labels)
    np.testing.assert_allclose(data.features["image"], images / 255.0)


def test_a_truncated_gz_file_is_named(tmp_path):
    write_mnist(tmp_path, "train", 20, gz=True)
    path = tmp_path / "train-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[:-30])
    with pytest.raises(ValueError, match=rf"{path}: not a complete gzip file .*; expected the whole download"):
        idx.mnist(tmp_path, "train")


def test_cli_trains_the_cnn_on_mnist_idx_files(tmp_path, capsys):
    write_mnist(tmp_path, "train", 256, seed=0)
    write_mnist(tmp_path, "t10k", 100, seed=1)
    model_dir = str(tmp_path / "run")
    common = ["--data", "mnist", "--data-dir", str(tmp_path), "--model-dir", model_dir, "--batch-size", "32"]
    cli.main(["train", *common, "--max-steps", "6", "--steps-per-loop", "3", "--loop", "step"])
    assert "held-out accuracy" in capsys.readouterr().out
    cli.main(["evaluate", *common])
    results = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert results["num_examples"] == 100
    assert cli.main(["train", "--data", "mnist"]) == 2
    assert "The mnist task received no data_dir" in capsys.readouterr().err


# -- TFRecord ----------------------------------------------------------------


def test_crc32c_and_record_framing_match_the_format():
    assert google_crc32c.value(b"123456789") == 0xE3069283  # the CRC-32C check value
    example = tfrecord.Example()
    example.features.feature["a"].int64_list.value.append(1)
    # Example{features{feature{key:"a" value{int64_list{value:1}}}}} by hand, field by field.
    int64_list = b"\x0a\x01\x01"  # packed repeated int64: [1]
    feature = b"\x1a" + bytes([len(int64_list)]) + int64_list
    entry = b"\x0a\x01a" + b"\x12" + bytes([len(feature)]) + feature
    features = b"\x0a" + bytes([len(entry)]) + entry
    assert example.SerializeToString() == b"\x0a" + bytes([len(features)]) + features


def _records(path):
    return tfrecord.Records(files.expand(path))


def test_tfrecord_features_fixed_variable_and_raw_bytes(tmp_path):
    path = str(tmp_path / "a.tfrecord")
    image = np.arange(12, dtype=np.uint8).reshape(3, 4)
    tfrecord.write(
        path, [{"image": image.tobytes(), "tokens": np.arange(k), "w": [0.5, 1.5], "y": k} for k in range(5)]
    )
    spec = {
        "image": tfrecord.Feature(np.uint8, (3, 4)),
        "tokens": tfrecord.Feature(np.int32, (), max_length=6),
        "w": tfrecord.Feature(np.float32, (2,)),
        "y": tfrecord.Feature(np.int32),
    }
    source = tfrecord.tfrecord(path, spec, label="y")
    ((features, labels),) = list(feed.eval_batches(source, 8))
    np.testing.assert_array_equal(features["image"], np.stack([image] * 5))
    np.testing.assert_array_equal(features["tokens_length"], np.arange(5))
    np.testing.assert_array_equal(features["tokens"][3], [0, 1, 2, 0, 0, 0])
    np.testing.assert_array_equal(features["w"], [[0.5, 1.5]] * 5)
    np.testing.assert_array_equal(labels, np.arange(5))
    assert features["tokens"].dtype == np.int32 and labels.dtype == np.int32


def test_corrupt_and_truncated_records_are_named(tmp_path):
    path = tmp_path / "c.tfrecord"
    tfrecord.write(path, [{"x": np.full(4, i, np.float32)} for i in range(5)])
    data = bytearray(path.read_bytes())
    size = len(data) // 5
    data[2 * size + 20] ^= 0xFF  # inside record 2's data
    path.write_bytes(bytes(data))
    records = _records(str(path))
    assert records[1][2] and len(records) == 5
    with pytest.raises(ValueError, match=rf"{path}: record 2 is corrupt: its data CRC is 0x[0-9a-f]+; expected 0x"):
        records[2]
    data[3 * size] ^= 0xFF  # record 3's length
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"{path}: record 3 is corrupt: its length's CRC"):
        len(_records(str(path)))
    path.write_bytes(bytes(data[: 2 * size + 5]))
    with pytest.raises(ValueError, match=rf"{path}: record 2 is truncated"):
        len(_records(str(path)))


def test_tfrecord_spec_errors_name_the_record_and_feature(tmp_path):
    path = str(tmp_path / "d.tfrecord")
    tfrecord.write(path, [{"x": np.zeros(3, np.float32), "y": 1}] * 2 + [{"x": np.zeros(2, np.float32), "y": 1}])
    wrong_size = tfrecord.tfrecord(path, {"x": tfrecord.Feature(np.float32, (3,))})
    with pytest.raises(ValueError, match=rf"{path}: record 2: feature 'x' has 2 values; expected 3 \(shape \(3,\)\)"):
        list(feed.eval_batches(wrong_size, 8))
    missing = tfrecord.tfrecord(path, {"x": tfrecord.Feature(np.float32, (3,)), "z": tfrecord.Feature(np.int64)})
    with pytest.raises(ValueError, match=rf"{path}: record 0 has no feature 'z'; expected .* \(found \['x', 'y'\]\)"):
        list(feed.eval_batches(missing, 8))
    floats_as_ints = tfrecord.tfrecord(path, {"x": tfrecord.Feature(np.int32, (3,))})
    with pytest.raises(ValueError, match=r"feature 'x' holds floats; expected int32"):
        list(feed.eval_batches(floats_as_ints, 8))


def test_globs_lists_and_in_memory_files():
    fs_prefix = "memory://"
    for k in range(3):
        tfrecord.write(f"{fs_prefix}/glob-test/part-{k}.tfrecord", [{"id": 10 * k + i} for i in range(k + 1)])
    spec = {"id": tfrecord.Feature(np.int64)}
    by_glob = tfrecord.tfrecord(f"{fs_prefix}/glob-test/part-*.tfrecord", spec)
    by_list = tfrecord.tfrecord(
        [f"{fs_prefix}/glob-test/part-2.tfrecord", f"{fs_prefix}/glob-test/part-0.tfrecord"], spec
    )
    ids = lambda source: np.concatenate([b[0]["id"] for b in feed.eval_batches(source, 4)]).tolist()  # noqa: E731
    assert ids(by_glob) == [0, 10, 11, 20, 21, 22]
    assert ids(by_list) == [20, 21, 22, 0]
    with pytest.raises(FileNotFoundError, match=r"'memory:///glob-test/none-\*' match no file"):
        files.expand(f"{fs_prefix}/glob-test/none-*")
    # Three files, two processes: process 0 reads files 0 and 2, process 1 file 1.
    per_process = [
        np.concatenate([b[0]["id"] for b in feed.eval_batches(by_glob, 4, shard=feed.Shard(p, 2))]) for p in range(2)
    ]
    assert sorted(per_process[0].tolist()) == [0, 20, 21, 22] and per_process[1].tolist() == [10, 11]


def test_arrays_are_a_grain_data_source():
    import grain

    data = ex.data.from_arrays({"x": np.arange(10)}, np.arange(10) * 2)
    example = grain.MapDataset.source(data)[3]
    assert example[0]["x"] == 3 and example[1] == 6
