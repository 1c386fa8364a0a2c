"""Images as context (the paper's image experiment, Fig. 5): a context of text and images for ``Gemma3ForConditionalGeneration``.

The full-context pass is the model's own multimodal forward: pixel values through SigLIP and the projector into
soft tokens, placed where the processor put the image tokens, with ``token_type_ids`` making each image's soft tokens
attend to each other bidirectionally while text stays causal. The query (the last text token) attends causally to
everything, so Theorem 1 applies at its position unchanged; the no-context pass is the query token alone through the
language model at its absolute position. ``Media`` carries what the full-context pass needs beyond token ids.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .hooks import UnsupportedArchitectureError

IMAGES = ("mars_sunset", "robot")     # the pictures shipped with the package (drawn by scripts/make_images.py, CC0)


class ImageContextError(ValueError):
    """A context of text and images cannot be built (no image placeholder, a model without vision, ...)."""


def packaged_image(name: str):
    """One of the package's own pictures (``IMAGES``) as a PIL image; works from an installed wheel."""
    from importlib.resources import files

    from PIL import Image
    if name not in IMAGES:
        raise ValueError(f"unknown packaged image {name!r}; choose one of: {', '.join(IMAGES)}")
    path = files("ctxpatch_lite") / "data" / "images" / f"{name}.png"
    with path.open("rb") as f:
        img = Image.open(f)
        img.load()
    img.ctxpatch_name = f"{name}.png"
    img.ctxpatch_sha256 = hashlib.sha256(path.read_bytes()).hexdigest()
    return img


def is_multimodal(model) -> bool:
    return getattr(model.config, "vision_config", None) is not None


def check_vision_model(model) -> None:
    """Only ``Gemma3ForConditionalGeneration``'s layout is known: say so in one line for anything else."""
    if not is_multimodal(model):
        raise ImageContextError(f"{type(model).__name__} has no vision tower: images in the context need a "
                                "multimodal model such as Gemma3ForConditionalGeneration (e.g. google/gemma-3-4b-it, "
                                "or ctxpatch_lite.fixtures.tiny_gemma3_vision())")
    if type(model).__name__ != "Gemma3ForConditionalGeneration":
        raise UnsupportedArchitectureError(
            f"{type(model).__name__} is a multimodal wrapper ctxpatch_lite has no adapter for: it knows "
            "Gemma3ForConditionalGeneration (decoder layers at model.language_model.layers, image blocks marked by "
            "token_type_ids); another wrapper needs where its language model's layers live and how its image tokens "
            "are masked")


@dataclass
class Media:
    """What the full-context pass needs besides token ids: the images' pixel values and the prompt's token types
    (1 = an image soft token), plus a JSON-ready record per image."""
    pixel_values: torch.Tensor
    token_type_ids: torch.Tensor          # (1, P) for the prompt
    images: list = field(default_factory=list)

    def kwargs(self, n_tokens: int, device, dtype) -> dict:
        """Keyword arguments of a forward over the first ``n_tokens`` tokens (prompt, then generated text)."""
        tt = self.token_type_ids.to(device)
        if n_tokens > tt.shape[1]:
            tt = torch.cat([tt, tt.new_zeros(1, n_tokens - tt.shape[1])], 1)
        return {"pixel_values": self.pixel_values.to(device=device, dtype=dtype), "token_type_ids": tt[:, :n_tokens]}


def _open(image, i: int):
    from PIL import Image
    if isinstance(image, (str, Path)):
        path = Path(image)
        if not path.is_file():
            raise ImageContextError(f"image {str(image)!r} does not exist")
        data = path.read_bytes()
        img = Image.open(path)
        img.load()
        return img, path.name, hashlib.sha256(data).hexdigest()
    if not hasattr(image, "convert"):
        raise ImageContextError(f"image {i} is a {type(image).__name__}: pass a PIL image or a file path")
    name = getattr(image, "ctxpatch_name", f"image{i}")
    sha = getattr(image, "ctxpatch_sha256", None) or hashlib.sha256(image.tobytes()).hexdigest()
    return image, name, sha


def encode_context(processor, text: str, images: list, model) -> tuple[list[int], Media]:
    """Token ids and ``Media`` of a context made of ``text`` and ``images``: each image goes where ``text`` holds
    the processor's image placeholder (Gemma 3: ``<start_of_image>``), in order."""
    check_vision_model(model)
    if not hasattr(processor, "image_processor"):
        raise ImageContextError(f"images need the model's processor (AutoProcessor), got a {type(processor).__name__}; "
                                "load_model returns it as the second value for a multimodal model")
    images = list(images)
    if not images:
        raise ImageContextError("images=[] : pass at least one image, or leave images out for a text-only context")
    marker = processor.tokenizer.boi_token
    if text.count(marker) != len(images):
        raise ImageContextError(f"the prompt holds {text.count(marker)} image placeholder(s) {marker!r} but "
                                f"{len(images)} image(s) were given: put {marker} where each image goes")
    opened = [_open(im, i) for i, im in enumerate(images)]
    inp = processor(images=[im.convert("RGB") for im, _, _ in opened], text=text, return_tensors="pt")
    ids = inp["input_ids"][0].tolist()
    soft = int(getattr(processor, "image_seq_length", 0))
    records = [{"name": name, "sha256": sha, "size": list(im.size), "processed_size": list(inp["pixel_values"].shape[-2:]),
                "soft_tokens": soft} for im, name, sha in opened]
    return ids, Media(pixel_values=inp["pixel_values"], token_type_ids=inp["token_type_ids"], images=records)


def attention_mask(model, ids: list[int], media: Media) -> torch.Tensor:
    """The (T, T) boolean mask the full-context pass uses on a full-attention layer: causal text, each image's soft
    tokens attending to each other both ways (True = may attend). For drawing (notebook 08)."""
    from transformers.models.gemma3 import modeling_gemma3 as mg

    tt = media.token_type_ids[0, :len(ids)]
    block = mg.get_block_sequence_ids_for_mask(tt[None])[0] if hasattr(mg, "get_block_sequence_ids_for_mask") else None
    T = len(ids)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    allowed = j <= i
    if block is not None:
        same = (block[:, None] == block[None, :]) & (block[:, None] >= 0)
        allowed = allowed | same
    return allowed
