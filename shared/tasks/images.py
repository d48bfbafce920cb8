"""Images for image classification: the built-in patterns, image folders (<dir>/<class>/<image>), the check that
every file decodes, and the dataset that turns images into the model's pixel_values. Imported by
image_classification.py alone, so a copy for another task carries none of it."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import torch

from ..core import data, datacheck
from ..core.boundary import loading
from ..core.datacheck import _SHOWN
from ..core.errors import InputError

IMAGE_GUESSES = ("image", "img", "pixel_values", "picture")  # the image column's common names


def pattern_images(n: int, seed: int, image_size: int) -> dict[str, list]:
    """uint8 RGB images of 4 classes (horizontal, vertical, checkerboard, diagonal stripes), random colours, noise."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:image_size, 0:image_size]
    images, labels = [], []
    for _ in range(n):
        label = int(rng.integers(4))
        period = int(rng.choice([2, 4])) * max(1, image_size // 32)
        y, x = (yy + int(rng.integers(period))) // period, (xx + int(rng.integers(period))) // period
        d = (yy + xx + int(rng.integers(period))) // period
        mask = [y, x, y + x, d][label] % 2
        fg, bg = rng.integers(140, 256, 3), rng.integers(0, 110, 3)  # light stripes on a dark ground
        img = np.where(mask[..., None] == 1, fg, bg) + rng.normal(0, 20, (image_size, image_size, 3))
        images.append(np.clip(img, 0, 255).astype(np.uint8))
        labels.append(label)
    return {"image": images, "label": labels}


def load_raw_splits(args) -> tuple[object, object, str]:
    """An image folder (--train_dir, --validation_dir), else data.py's sources (files, the hub, the built-in data)."""
    if not args.train_dir:
        return data.load_raw_splits(args)
    data.SKIPPED.clear()
    with loading("image folder", "--train_dir", args.train_dir):
        train = image_folder(args.train_dir)
    with loading("image folder", "--validation_dir", args.validation_dir):
        val = image_folder(args.validation_dir, classes=train["classes"]) if args.validation_dir else None
    return train, val, f"image folder {args.train_dir}"


def hold_out(train: object, val: object | None, source: str) -> tuple[object, object]:
    """data.hold_out, and for an image folder without --validation_dir 10% of its images, the same for every seed."""
    if val is not None or not isinstance(train, dict):
        return data.hold_out(train, val, source)
    datacheck.check_can_hold_out(len(train["label"]), source)
    return _split_dict(train)


def _split_dict(d: dict[str, list]) -> tuple[dict, dict]:
    n = len(d["label"])
    order = random.Random(0).sample(range(n), n)
    cut = max(1, n // 10)
    pick = lambda idx: {"image": [d["image"][i] for i in idx], "label": [d["label"][i] for i in idx],  # noqa: E731
                        "classes": d["classes"]}
    return pick(order[cut:]), pick(order[:cut])


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
_JUNK = ("Thumbs.db", "desktop.ini")  # what file managers leave beside images


def image_folder(root: str, classes: list[str] | None = None) -> dict[str, list]:
    """Paths and labels from root/<class>/<image>; classes sorted by name, as torchvision's ImageFolder does.
    Hidden folders (.ipynb_checkpoints) are not classes; a subfolder inside a class, or a file of a type no loader
    reads, is refused: its images would be skipped without a word."""
    root_path = Path(root)
    if not root_path.is_dir():
        raise InputError(f"{root!r} is a file; an image folder is expected ({root_path.parent}/<class>/<image>). "
                         "Pass the folder that holds the class subfolders.")
    entries = sorted(root_path.iterdir())
    found = [p.name for p in entries if p.is_dir() and not p.name.startswith(".")]
    skipped = data.SKIPPED  # what the data report shows as left out, and why
    skipped.extend(f"{p} (hidden folder, not a class)" for p in entries if p.is_dir() and p.name.startswith("."))
    skipped.extend(f"{p} (a file beside the class folders)" for p in entries if p.is_file())
    if not found:
        raise InputError(f"{root!r} holds no class subfolders. Lay images out as {root}/<class_name>/<image>.png.")
    classes = classes or found
    unknown = set(found) - set(classes)
    if unknown:
        raise InputError(f"{root!r} has classes {sorted(unknown)} that the training folder lacks.")
    paths, labels, nested, other = [], [], [], []
    for label, name in enumerate(classes):
        for p in sorted((root_path / name).glob("*")):
            if p.name.startswith(".") or p.name in _JUNK:
                skipped.append(f"{p} (hidden or file-manager file)")
            elif p.is_dir():
                nested.append(p)
            elif p.suffix.lower() in IMAGE_SUFFIXES:
                paths.append(str(p))
                labels.append(label)
            else:
                other.append(p)
    if nested:
        raise InputError(f"{root!r}: class folders hold subfolders ({', '.join(map(str, nested[:5]))}), whose images "
                         "would not train. Move their images up into the class folder, or, if the subfolders are "
                         f"the classes, pass --train_dir {str(nested[0].parent)!r}.")
    if other:
        raise InputError(f"{root!r}: {len(other)} file(s) of a type no loader reads would be skipped "
                         f"({', '.join(map(str, other[:5]))}). Convert them to {', '.join(IMAGE_SUFFIXES[:3])} ..., or "
                         "move them out of the class folders.")
    if not paths:
        raise InputError(f"{root!r} holds no images ({', '.join(s.lstrip('.') for s in IMAGE_SUFFIXES)}).")
    seen = set(labels)
    empty = [name for label, name in enumerate(classes) if label not in seen]
    if empty and classes is found:  # training: each folder is a class the head gets a row for, and learns nothing of
        raise InputError(f"{root!r}: class folder(s) {empty} hold no images, so the classifier would get classes it "
                         "never sees. Add their images, or remove the empty folders.")
    if len(classes) < 2 and classes is found:
        raise InputError(f"{root!r} holds one class folder ({classes[0]!r}): a classifier needs at least two, and one "
                         f"class would score accuracy 1.0 having learned nothing. Lay out {root}/<class_name>/ per "
                         "class.")
    return {"image": paths, "label": labels, "classes": classes}



def check_images(paths: list, split: str, table: str | None = None) -> None:
    """Every image file decodes: a truncated one (an interrupted copy) opens and verifies, then crashes evaluation.
    All are decoded, as a sample would miss the one bad file; JPEGs in draft mode (scaled, yet every byte read).
    `table`: the csv/json file the paths come from, whose folder relative paths may have been written against."""
    from PIL import Image

    gone = [p for p in paths if isinstance(p, str) and not os.path.isabs(p) and not os.path.exists(p)]
    if table and gone and all(os.path.exists(os.path.join(os.path.dirname(table), p)) for p in gone[:_SHOWN]):
        raise InputError(f"{len(gone)} {split} image path(s) in {table} are relative ({gone[0]!r} ...) and are read "
                         f"from the current directory {os.getcwd()}, where they are not; they are there relative to "
                         f"the table's folder {os.path.dirname(table) or '.'}. Run from that folder, or write the "
                         "paths absolute (or relative to where you run).")
    broken, odd = [], []
    for path in paths:
        if not isinstance(path, str):  # already decoded (a hub dataset's Image feature, the built-in arrays)
            continue
        try:
            with Image.open(path) as image:
                image.draft("RGB", (64, 64))
                image.load()
                if image.mode in ("I", "F"):  # 32-bit: convert("RGB") clips every value above 255 to white
                    odd.append(f"{path} (mode {image.mode})")
        except Image.DecompressionBombError as err:  # PIL's guard: kept, and the user decides
            raise InputError(f"{path}: {err} Resize it (the model sees a few hundred pixels a side), or, trusting "
                             "the file, raise the limit before main(): PIL.Image.MAX_IMAGE_PIXELS = <pixels>.") from err
        except Exception as err:  # noqa: BLE001 (the loading boundary: whatever PIL raises on a file)
            broken.append(f"{path} ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})")
    if odd:
        raise InputError(f"{len(odd)} {split} image(s) hold 32-bit integer or float pixels ({', '.join(odd[:_SHOWN])})"
                         ": read as RGB every value above 255 would be white. Save them as 8- or 16-bit PNG "
                         "(scaled to their range).")
    if broken:
        raise InputError(f"{len(broken)} {split} image(s) do not open or decode: {', '.join(broken[:_SHOWN])}. "
                         "Remove or replace them (a truncated file is often an interrupted copy: copy it again).")


RESAMPLE = 3  # PIL's BICUBIC (Image.resize's default): the dataset and the saved image processor resize alike


def image_processor(size: int, mean: list[float], std: list[float]):
    """A ViT image processor that does what ImageDataset does: resize to size x size, scale to [0, 1], normalize."""
    import importlib.util

    import transformers

    # Transformers 5 builds ViTImageProcessor on torchvision; the PIL one is the same processing without it.
    cls = (transformers.ViTImageProcessor if importlib.util.find_spec("torchvision")
           else transformers.ViTImageProcessorPil)
    return cls(do_resize=True, size={"height": size, "width": size}, resample=RESAMPLE, do_rescale=True,
               rescale_factor=1 / 255, do_normalize=True, image_mean=mean, image_std=std)


class ImageDataset(torch.utils.data.Dataset):
    """uint8 arrays or image paths -> normalized pixel_values at the model's size."""

    def __init__(self, images: list, labels: list[int], image_size: int, mean: list[float], std: list[float]):
        self.images, self.labels, self.size = images, labels, image_size
        self.mean = torch.tensor(mean).view(3, 1, 1)
        self.std = torch.tensor(std).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        img = self.images[i]
        if not isinstance(img, np.ndarray):
            from PIL import Image

            with loading("image", None, img if isinstance(img, str) else "an image of the dataset"):
                pil = img if isinstance(img, Image.Image) else Image.open(img)
                if pil.mode.startswith("I;16"):  # 16-bit grey: convert("RGB") clips at 255 (nearly all white)
                    pil = Image.fromarray((np.asarray(pil) / 257).round().astype(np.uint8))  # 65535 -> 255
                img = np.asarray(pil.convert("RGB").resize((self.size, self.size), RESAMPLE))
        elif img.shape[0] != self.size:
            from PIL import Image

            img = np.asarray(Image.fromarray(img).resize((self.size, self.size), RESAMPLE))
        x = torch.from_numpy(np.array(img)).permute(2, 0, 1).float() / 255.0  # np.array: a writable copy
        return {"pixel_values": (x - self.mean) / self.std, "labels": torch.tensor(self.labels[i])}

    def report_example(self, i: int) -> dict:
        """Image i as the data report shows it (shared/core/datareport.py): the tensor the model receives, and the
        file it came from."""
        item = self[i]
        pixels, img = item["pixel_values"], self.images[i]
        if isinstance(img, str):
            from PIL import Image

            with Image.open(img) as pil:
                source = f"{img} ({pil.mode}, {pil.size[0]}x{pil.size[1]}) -> RGB"
        else:
            source = f"array {getattr(img, 'shape', '?')}"
        return {"pixel_values": list(pixels.shape), "dtype": str(pixels.dtype).replace("torch.", ""),
                "mean": round(float(pixels.mean()), 4), "label_id": int(item["labels"]), "source": source}
