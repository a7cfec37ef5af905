"""Builds an offline TFDS data dir for `tiny_shakespeare` from the shared copy of its file.

Why: the data tests must exercise the real `tfds.data_source` code path (download_and_prepare
into array_record, then read) on a machine without network. TFDS treats a download as cached
when the file sits in `DATA_DIR/downloads/<dataset>/<dl_fname>` beside a `.INFO` file, so we
place the byte-identical shared file there and let TFDS do everything else itself. The URL,
size and sha256 come from TFDS's own `checksums.tsv` (the builder's `url_infos`), and the
shared file is verified against them, so a wrong file fails here rather than deep in TFDS.
"""

import hashlib
import pathlib
import shutil

import pytest

DATASET = "tiny_shakespeare"
# The shared data lives beside the repository, never inside it (see ../shared/data/README.md).
REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
SHARED_TEXT = REPO_ROOT / ".." / "shared" / "data" / "tinyshakespeare.txt"


def build_offline_data_dir(data_dir: pathlib.Path, source: pathlib.Path = SHARED_TEXT) -> pathlib.Path:
  """Seeds `data_dir` with a TFDS download cache for tiny_shakespeare so preparing needs no network.

  Only the download cache is written; preparing (array_record files, dataset_info.json) is left to
  TFDS itself when `load_corpus` calls `tfds.data_source`, which is the code path under test.
  """
  # pylint: disable=g-import-not-at-top
  import tensorflow_datasets as tfds
  from tensorflow_datasets.core.download import checksums
  from tensorflow_datasets.core.download import resource
  from etils import epath

  (url, url_info), = tfds.builder_cls(DATASET).url_infos.items()
  data = source.read_bytes()
  if len(data) != url_info.size or hashlib.sha256(data).hexdigest() != url_info.checksum:
    raise ValueError(f"{source} is not the file TFDS expects for {DATASET} ({url})")
  download_dir = data_dir / "downloads" / DATASET
  download_dir.mkdir(parents=True, exist_ok=True)
  cached = download_dir / resource.get_dl_fname(url, url_info.checksum)
  shutil.copyfile(source, cached)
  resource.write_info_file(
      url=url,
      path=epath.Path(cached),
      dataset_name=DATASET,
      original_fname=url_info.filename,
      url_info=checksums.UrlInfo(size=url_info.size, checksum=url_info.checksum, filename=url_info.filename),
  )
  return data_dir


@pytest.fixture(scope="session")
def tiny_shakespeare_data_dir(tmp_path_factory) -> pathlib.Path:
  """A TFDS data dir (under pytest's tmp dir) from which tiny_shakespeare prepares offline."""
  if not SHARED_TEXT.is_file():
    pytest.skip(f"shared tiny Shakespeare file not found at {SHARED_TEXT}")
  return build_offline_data_dir(tmp_path_factory.mktemp("tfds"))
