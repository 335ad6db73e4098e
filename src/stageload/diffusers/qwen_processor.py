"""A Qwen3-VL processor without the video processor, for fixtures built without torchvision.

transformers' video processors need torchvision, which stageload does not depend on. The
Qwen-Image pipelines read prompts and images only, so the fixtures save this subclass
instead; diffusers records it under this module's path in ``model_index.json`` and loads it
back while this module is imported (``stageload.testing.diffusers`` imports it).
"""

from __future__ import annotations

from typing import Any

from transformers import Qwen3VLProcessor
from transformers.processing_utils import ProcessorMixin  # noqa: F401  (diffusers looks it up here)


class Qwen3VLTextImageProcessor(Qwen3VLProcessor):
    """Qwen3VLProcessor with an image processor and a tokenizer, and no video processor."""

    def __init__(
        self,
        image_processor: Any = None,
        tokenizer: Any = None,
        chat_template: Any = None,
        **kwargs: Any,
    ) -> None:
        self.image_token = getattr(tokenizer, "image_token", "<|image_pad|>")
        self.video_token = getattr(tokenizer, "video_token", "<|video_pad|>")
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)
        self.vision_start_token = getattr(tokenizer, "vision_start_token", "<|vision_start|>")
        self.vision_end_token = getattr(tokenizer, "vision_end_token", "<|vision_end|>")
        self.vision_start_token_id = tokenizer.convert_tokens_to_ids(self.vision_start_token)
        self.vision_end_token_id = tokenizer.convert_tokens_to_ids(self.vision_end_token)
