"""Tasks: what a checkpoint is exported for, and the model class that does it.

The task names are the ones ``optimum-cli export`` uses where they fit (``text-generation``,
``image-classification``, ...). Each task is a list of transformers auto mappings; a checkpoint's
task is inferred from its ``config.architectures`` by looking the class up in those mappings, in
the order of :data:`TASKS` (an encoder-decoder ``...ForConditionalGeneration`` is in both the
seq2seq and the masked-LM mappings: seq2seq comes first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hfexport.errors import ConfigError


@dataclass(frozen=True)
class Task:
    """A task: its auto classes, each with the name of its mapping in
    ``transformers.models.auto.modeling_auto`` (without the ``_MAPPING_NAMES`` suffix)."""

    name: str
    auto_classes: tuple[tuple[str, str], ...]

    def mappings(self) -> list[dict[str, Any]]:
        from transformers.models.auto import modeling_auto

        return [getattr(modeling_auto, f"{mapping}_MAPPING_NAMES", {}) for _, mapping in self.auto_classes]

    def holds_class(self, class_name: str) -> bool:
        """Whether one of the task's mappings names ``class_name``."""
        return any(class_name in _names(value) for mapping in self.mappings() for value in mapping.values())

    def auto_class_for(self, model_type: str) -> str | None:
        """The first auto class of the task that has a class for ``model_type``."""
        for (auto_class, _), mapping in zip(self.auto_classes, self.mappings(), strict=True):
            if model_type in mapping:
                return auto_class
        return None


def _names(value: Any) -> tuple[str, ...]:
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


# inference order: the first task whose mappings hold a checkpoint's architecture is its task
TASKS: dict[str, Task] = {
    task.name: task
    for task in (
        Task("text-generation", (("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM"),)),
        Task("text2text-generation", (("AutoModelForSeq2SeqLM", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM"),)),
        Task(
            "automatic-speech-recognition",
            (("AutoModelForSpeechSeq2Seq", "MODEL_FOR_SPEECH_SEQ_2_SEQ"), ("AutoModelForCTC", "MODEL_FOR_CTC")),
        ),
        Task("image-text-to-text", (("AutoModelForImageTextToText", "MODEL_FOR_IMAGE_TEXT_TO_TEXT"),)),
        Task("text-classification", (("AutoModelForSequenceClassification", "MODEL_FOR_SEQUENCE_CLASSIFICATION"),)),
        Task("token-classification", (("AutoModelForTokenClassification", "MODEL_FOR_TOKEN_CLASSIFICATION"),)),
        Task("question-answering", (("AutoModelForQuestionAnswering", "MODEL_FOR_QUESTION_ANSWERING"),)),
        Task("fill-mask", (("AutoModelForMaskedLM", "MODEL_FOR_MASKED_LM"),)),
        Task("image-classification", (("AutoModelForImageClassification", "MODEL_FOR_IMAGE_CLASSIFICATION"),)),
        Task("audio-classification", (("AutoModelForAudioClassification", "MODEL_FOR_AUDIO_CLASSIFICATION"),)),
        Task("object-detection", (("AutoModelForObjectDetection", "MODEL_FOR_OBJECT_DETECTION"),)),
        Task("semantic-segmentation", (("AutoModelForSemanticSegmentation", "MODEL_FOR_SEMANTIC_SEGMENTATION"),)),
        Task("depth-estimation", (("AutoModelForDepthEstimation", "MODEL_FOR_DEPTH_ESTIMATION"),)),
        Task(
            "zero-shot-image-classification",
            (("AutoModelForZeroShotImageClassification", "MODEL_FOR_ZERO_SHOT_IMAGE_CLASSIFICATION"),),
        ),
        Task("feature-extraction", (("AutoModel", "MODEL"),)),
    )
}

# tasks whose sample is a pair of texts (the tokenizer then gives token_type_ids their second segment)
TEXT_PAIR_TASKS = ("text-classification", "question-answering")


def infer_task(config: Any) -> str:
    """The task of a checkpoint: the first of :data:`TASKS` whose mappings hold its
    ``config.architectures[0]``; ``feature-extraction`` when it names none (or no class)."""
    architecture = (getattr(config, "architectures", None) or [None])[0]
    if architecture:
        for task in TASKS.values():
            if task.holds_class(architecture):
                return task.name
    return "feature-extraction"


def tasks_for(model_type: str) -> list[str]:
    """The tasks transformers has a class for ``model_type`` in."""
    return [task.name for task in TASKS.values() if task.auto_class_for(model_type) is not None]


def model_class(config: Any, task: str | None = None, remote_code: bool = False) -> Any:
    """The class that loads a checkpoint of ``config`` for ``task`` (default: :func:`infer_task`):
    the checkpoint's own architecture when it does the task, else the task's auto class.
    ``remote_code``: the checkpoint's own code (``auto_map``) decides, through the auto class."""
    import transformers

    if task is not None and task not in TASKS:
        raise ConfigError(f"unknown task {task!r}; tasks: {', '.join(TASKS)}")
    task = task or infer_task(config)
    architecture = (getattr(config, "architectures", None) or [None])[0]
    if not remote_code and architecture and TASKS[task].holds_class(architecture):
        found = getattr(transformers, architecture, None)
        if found is not None:
            return found
    model_type = getattr(config, "model_type", "")
    auto_class = TASKS[task].auto_class_for(model_type)
    if remote_code:
        auto_class = _remote_auto_class(config, task) or auto_class
    if auto_class is None:
        supported = ", ".join(tasks_for(model_type)) or "none"
        raise ConfigError(
            f"--task {task} does not apply to model type {model_type!r} (transformers has no class for it); "
            f"its tasks: {supported}"
        )
    return getattr(transformers, auto_class)


def _remote_auto_class(config: Any, task: str) -> str | None:
    """The task's auto class that the checkpoint's ``auto_map`` names, if any."""
    auto_map = getattr(config, "auto_map", None) or {}
    for auto_class, _ in TASKS[task].auto_classes:
        if auto_class in auto_map:
            return auto_class
    return next(iter(c for c in auto_map if c.startswith("AutoModel")), None)
