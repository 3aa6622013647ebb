"""A vision dataset's images as the run will decode them: each image's (height, width), turned by its EXIF
orientation (as `load_image` and `datasets` turn it), a file that cannot be decoded failing here; an image URL
fetched within a time and a size bound (`SHAPEPLAN_IMAGE_TIMEOUT`, `SHAPEPLAN_IMAGE_MAX_MIB`), which
`load_image` does not have; and a dataset's images resized to fixed sizes (`shapeplan.resize_images`)."""

from __future__ import annotations

import base64
import binascii
import http.client
import io
import math
import os
import socket
import time
import urllib.error
import urllib.request
from typing import Any

from ...errors import DatasetError, UsageError, first_line
from ...plan.vision import FixedSizes

_EXIF_ORIENTATION = 0x0112
_SWAPPED = {5, 6, 7, 8}  # orientations exif_transpose turns by 90 degrees: height and width swap
# transformers' `load_image` fetches a URL with no timeout and reads the whole body: a server that never answers
# hangs the run, an endless body exhausts its memory. shapeplan fetches within these (docs/bounds.md).
IMAGE_TIMEOUT_S = 30.0
IMAGE_MAX_MIB = 64.0


def image_columns(dataset: Any) -> list[str]:
    """The dataset's `image` / `images` columns, which make it a vision dataset for TRL (`SFTTrainer.__init__`: the
    first row has an `image` or `images` key)."""
    names = dataset.column_names
    if names is None:  # a stream whose columns only its first row tells (TRL's get_dataset_column_names)
        from trl.data_utils import get_dataset_column_names

        names = get_dataset_column_names(dataset)
    return sorted({"image", "images"} & set(names))


def is_vision(dataset: Any) -> bool:
    return bool(image_columns(dataset))


def _open(source: bytes | str) -> Any:
    """An image file (its bytes or its path), opened lazily: only the header is read."""
    from PIL import Image

    return Image.open(io.BytesIO(source) if isinstance(source, bytes) else source)


def _decoded_size(data: bytes | str) -> tuple[int, int]:
    """(height, width) of an image file after `ImageOps.exif_transpose`. Its pixels are decoded (`load`), as the run's
    image loading decodes them: a truncated or corrupt file fails here, not in the run's collator (`verify` reads
    a JPEG's markers only, and passes a file cut in its data)."""
    with _open(data) as image:
        image.load()
        width, height = image.size
        turned = image.getexif().get(_EXIF_ORIENTATION) in _SWAPPED
    return (width, height) if turned else (height, width)


def _setting(name: str, default: float, high: float) -> float:
    text = os.environ.get(name, "")
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= high:  # NaN too
        raise UsageError(f"{name}={text!r} is not a number above 0 and at most {high:g}; set e.g. {default:g} or "
                         "unset it")
    return value


def fetch(url: str) -> bytes:
    """The file at an image URL, as `load_image` fetches it (redirects followed), waiting SHAPEPLAN_IMAGE_TIMEOUT
    seconds at most for the server's answer and as long for the whole file, of SHAPEPLAN_IMAGE_MAX_MIB at most;
    raises ValueError with what went wrong, naming the setting that bounds it."""
    timeout = _setting("SHAPEPLAN_IMAGE_TIMEOUT", IMAGE_TIMEOUT_S, 3600)
    limit = int(_setting("SHAPEPLAN_IMAGE_MAX_MIB", IMAGE_MAX_MIB, 1 << 20) * (1 << 20))
    slow = ValueError(f"no whole answer within {timeout:g} s (SHAPEPLAN_IMAGE_TIMEOUT; raise it for a slow server)")
    large = ValueError(f"over {limit / (1 << 20):g} MiB (SHAPEPLAN_IMAGE_MAX_MIB; raise it for larger images)")
    deadline = time.monotonic() + timeout
    data = bytearray()
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            declared = response.headers.get("Content-Length", "")
            if declared.isdigit() and int(declared) > limit:
                raise large
            # each wait for the server within what is left of the whole fetch: a server sending a byte at a time
            # would otherwise hold every read below the timeout
            sock = getattr(getattr(response.fp, "raw", None), "_sock", None)
            while chunk := _read(response, sock, deadline, slow):
                data += chunk
                if len(data) > limit:
                    raise large
    except urllib.error.HTTPError as exc:
        raise ValueError(f"the server answered HTTP {exc.code} {exc.reason}") from None
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, TimeoutError):
            raise slow from None
        raise ValueError(f"cannot fetch it ({exc.reason})") from None
    except TimeoutError:  # socket.timeout too
        raise slow from None
    except (http.client.HTTPException, OSError) as exc:  # a broken answer, a reset connection, TLS
        raise ValueError(f"cannot fetch it ({first_line(exc, named=True)})") from None
    return bytes(data)


def _read(response: Any, sock: socket.socket | None, deadline: float, slow: ValueError) -> bytes:
    left = deadline - time.monotonic()
    if left <= 0:
        raise slow
    if sock is not None:
        sock.settimeout(left)
    return bytes(response.read1(1 << 16))


def image_size(value: Any) -> tuple[int, int]:
    """The (height, width) the processor resizes from, for an image as a dataset row holds it: a PIL image (as
    `datasets` decodes it: already turned), the {"bytes", "path"} of an undecoded `datasets` Image, or a string,
    which transformers' `load_image` reads as a URL, a file path or base64, and turns. Raises ValueError with the
    reason it cannot be opened."""
    from PIL import Image, UnidentifiedImageError

    try:
        if isinstance(value, Image.Image):
            return value.height, value.width
        if isinstance(value, dict) and ("bytes" in value or "path" in value):
            source = value.get("bytes") or value.get("path")
            if not source:
                raise ValueError("an Image value with neither bytes nor path")
            return _decoded_size(source)
        if isinstance(value, str):
            if value.startswith(("http://", "https://")):
                return _decoded_size(fetch(value))
            if os.path.isfile(value):
                return _decoded_size(value)
            if os.path.isdir(value):
                raise ValueError("a folder, not an image file")
            if value.startswith("data:image/"):
                value = value.split(",", 1)[-1]
            try:
                data = base64.b64decode(value, validate=True)
            except (binascii.Error, ValueError):
                raise ValueError("no such file") from None
            try:
                return _decoded_size(data)
            except UnidentifiedImageError:  # a missing file's name that is base64 too ("data"): a path, most likely
                raise ValueError("no such file (nor base64 of an image)") from None
    except FileNotFoundError:
        raise ValueError("no such file") from None
    except UnidentifiedImageError:
        raise ValueError("not an image PIL can open") from None
    except Image.DecompressionBombError:  # Pillow refuses it in the run's processor too
        raise ValueError(f"over Pillow's decompression-bomb limit ({2 * (Image.MAX_IMAGE_PIXELS or 0):,} pixels), "
                         "which the run's image loading refuses as well") from None
    except (OSError, SyntaxError) as exc:  # a known format whose data is truncated or corrupt
        raise ValueError(f"a corrupt image ({first_line(exc)})") from None
    raise ValueError(f"a {type(value).__name__}, not an image, a path, a URL or base64")


def undecoded(dataset: Any) -> Any:
    """The dataset with its `datasets` Image columns left undecoded: `image_size` decodes each as the run does."""
    import datasets

    features = getattr(dataset, "features", None) or {}
    for column in ("image", "images"):
        feature = features.get(column)
        if isinstance(feature, datasets.Image):
            dataset = dataset.cast_column(column, datasets.Image(decode=False))
        elif isinstance(feature, (datasets.Sequence, datasets.List)) and isinstance(feature.feature, datasets.Image):
            dataset = dataset.cast_column(column, type(feature)(datasets.Image(decode=False)))
    return dataset


def _row_images(example: dict[str, Any], index: int, name: str) -> list[Any]:
    if "image" in example:
        return [] if example["image"] is None else [example["image"]]
    images = example.get("images") or []
    if not isinstance(images, (list, tuple)):
        raise DatasetError(f"row {index} of the {name} dataset has an 'images' value that is a "
                           f"{type(images).__name__}, not a list of images; give a list (or use an 'image' column)")
    return list(images)


# -- fewer sizes -----------------------------------------------------------------------------------------------------

def resize_images(dataset: Any, sizes: Any) -> Any:
    """`dataset` with every image of a row (`image` or `images`) resized to the one of `sizes`, (height, width)
    pairs as `shapeplan advise` lists them, with the nearest aspect ratio: the processor then keeps each image's
    size, so the run meets only those grids. A `datasets.map` over the rows, stored as `datasets` Image features.

        import shapeplan
        dataset = shapeplan.resize_images(dataset, [(448, 448), (336, 588)])

    Images are read as the run reads them (a path, URL or base64 with `load_image`, which turns them by EXIF), and
    resized with Pillow's bicubic filter, the processor's own."""
    import datasets

    try:
        fixed = FixedSizes(tuple((int(h), int(w)) for h, w in sizes))
    except (TypeError, ValueError):
        raise UsageError("resize_images takes (height, width) pairs, as `shapeplan advise` lists them") from None
    if not fixed.sizes or any(h < 1 or w < 1 for h, w in fixed.sizes):
        raise UsageError("resize_images needs at least one (height, width) pair of positive sides")
    features = dataset.features.copy() if dataset.features is not None else None
    columns = [c for c in ("image", "images") if c in (dataset.column_names or ())]
    if features is not None:
        for column in columns:  # rows of no image first would leave the type to guess: it is an image
            features[column] = datasets.Image() if column == "image" else datasets.List(datasets.Image())

    def resize(row: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if "image" in columns:
            out["image"] = None if row["image"] is None else _resized(row["image"], fixed)
        if "images" in columns:
            out["images"] = [_resized(image, fixed) for image in row["images"] or []]
        return out

    return dataset.map(resize, features=features)


def _resized(value: Any, fixed: FixedSizes) -> Any:
    from PIL import Image, ImageOps
    from transformers.image_utils import load_image

    if isinstance(value, Image.Image):
        image = value  # as `datasets` decodes it: already turned
    elif isinstance(value, dict) and (value.get("bytes") or value.get("path")):
        image = ImageOps.exif_transpose(_open(value.get("bytes") or value["path"]))
    elif isinstance(value, str) and value.startswith(("http://", "https://")):
        image = load_image(_open(fetch(value)))  # bounded, then turned as load_image turns it
    else:
        image = load_image(value)
    height, width = fixed.target(image.height, image.width)
    return image.convert("RGB").resize((width, height), Image.Resampling.BICUBIC)
