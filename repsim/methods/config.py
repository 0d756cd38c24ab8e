"""Experiment configs: pydantic models read from YAML, merged over defaults, overridable by ``a.b=value``.

A config file (a path, or the name of a shipped config: ``xclr``) sets what differs from the
models' defaults here, the one place defaults live; then each override is applied in order
(mappings merge key by key; a mapping whose ``type`` or ``name`` changes is replaced whole, so
switching a similarity source drops the old source's fields). Override values are parsed as YAML
(``optim.lr=0.1``, ``monitor.knn=false``, ``optim.grad_clip=null``). Relative paths resolve against
the folder of the file that names them; paths given in overrides resolve against the working
directory (see :mod:`repsim.layering`). Every error is one line naming the file (or the override),
the field and the fix.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args

from pydantic import BaseModel, Field, model_validator

from repsim.data.augment import PRESETS
from repsim.errors import SpecError, first_line
from repsim.layering import SettingsFile, Strict, load_model
from repsim.models.backbones import RESNETS
from repsim.models.vit import VITS
from repsim.shipped import packaged

DEFAULT_SPEC = "animal-mnist"  # the shipped data spec a config trains on unless it names one
ENTRY_POINTS = "repsim.methods"  # the entry-point group under which a package names its methods' modules
PATH_FIELDS = ("data.spec", "method.similarity.path", "model.init_encoder", "image.path")  # image: alignment configs
CONFIG_FILE = SettingsFile("config", "configs/simclr.yaml", "optim.lr=0.01", PATH_FIELDS)


class DataConfig(Strict):
    """What to train on: a data spec, its training split and the augmentation preset."""

    spec: Path = Field(default_factory=lambda: packaged("data spec", DEFAULT_SPEC),
                       description="data spec YAML; default: the shipped animal-mnist (28×28 silhouettes, 10 classes)")
    split: str = "train"
    preset: Literal[tuple(PRESETS)] = "simclr"
    preset_options: dict[str, Any] = {}
    augment: Literal["sample", "batch"] = Field("sample", description="sample: each image's views in the loader "
                                                "workers (torchvision); batch: a batch's views in one call on the "
                                                "training device (kornia)")
    image_size: int | None = Field(28, gt=0, description="side of the views; None: the images' own")


class ModelConfig(Strict):
    """The backbone and the projection head on top of it."""

    backbone: Literal[RESNETS + VITS] = "resnet18"
    small_images: bool = True
    patch_size: int = Field(4, gt=0, description="ViT patch side in pixels (4 for 28 px images, 16 for 224 px)")
    depth: int = Field(12, gt=0, description="ViT blocks")
    projection_hidden_dim: int = Field(512, gt=0)
    projection_dim: int = Field(128, gt=0)
    projection_layers: int = Field(2, ge=1)
    init_encoder: Path | None = Field(None, description="a saved encoder (a train stage's encoder.pt or its "
                                      "directory) whose weights start the backbone; None: random weights")


class OptimConfig(Strict):
    """Optimisation; ``batch_size`` is global (split evenly between DDP ranks)."""

    optimizer: Literal["adamw", "lars"] = "adamw"
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(1e-4, ge=0)
    momentum: float = Field(0.9, ge=0, lt=1, description="LARS momentum")
    trust_coefficient: float = Field(1e-3, gt=0, description="LARS trust coefficient")
    batch_size: int = Field(256, gt=0)
    epochs: int = Field(5, gt=0)
    max_steps: int | None = Field(None, gt=0, description="stop after this many steps, mid-epoch if need be "
                                  "(the schedule ends there); None: train every epoch")
    warmup_epochs: float = Field(1.0, ge=0)
    grad_clip: float | None = Field(None, gt=0)
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    channels_last: bool = False
    compile: bool = False
    seed: int = 0
    num_workers: int | None = Field(None, ge=0, description="DataLoader workers; default: repsim.device.cpu_plan")
    threads: int | None = Field(None, gt=0, description="torch intra-op threads; default: the cores the workers leave")
    checkpoint_every: int = Field(50, ge=0, description="steps between checkpoints; 0: only at the end")


class MonitorConfig(Strict):
    """The online kNN monitor: eval-preset features of the training and ``test_split`` samples, each epoch."""

    knn: bool = True
    k: int = Field(20, gt=0)
    test_split: str = "test"
    batch_size: int = Field(512, gt=0)


class CaptionsSimilarity(Strict):
    """Cosine similarity of caption embeddings from a frozen sentence-transformer (default all-MiniLM-L6-v2)."""

    type: Literal["captions"]
    model: str | None = None


class WordnetSimilarity(Strict):
    """WordNet similarity of the classes' synsets."""

    type: Literal["wordnet"]
    measure: Literal["wup", "path", "lch", "hops"] = "wup"


class LabelsSimilarity(Strict):
    """1 for the same label, else 0."""

    type: Literal["labels"]


class IdentitySimilarity(Strict):
    """1 for a sample with itself, else 0: X-CLR's loss towards SimCLR's targets (an ablation of the
    soft graph, NT-Xent as ``target_temperature`` -> 0)."""

    type: Literal["identity"]


class MatrixSimilarity(Strict):
    """A user's (C, C) class similarity, CSV or Parquet (see ``load_class_matrix``)."""

    type: Literal["matrix"]
    path: Path


class GraphSimilarity(Strict):
    """A user's sparse sample graph with columns key_i, key_j, s (manifest keys), CSV or Parquet."""

    type: Literal["graph"]
    path: Path


Similarity = Annotated[CaptionsSimilarity | WordnetSimilarity | LabelsSimilarity | IdentitySimilarity |
                       MatrixSimilarity | GraphSimilarity, Field(discriminator="type")]


class XCLRConfig(Strict):
    """X-CLR: ``temperature`` of the prediction, ``target_temperature`` of the similarity targets."""

    name: Literal["xclr"]
    temperature: float = Field(0.1, gt=0)
    target_temperature: float = Field(0.1, gt=0)
    similarity: Similarity = CaptionsSimilarity(type="captions")


class SimCLRConfig(Strict):
    """SimCLR's NT-Xent at ``temperature``."""

    name: Literal["simclr"]
    temperature: float = Field(0.1, gt=0)


class SupConConfig(Strict):
    """SupCon at ``temperature``; needs labelled data."""

    name: Literal["supcon"]
    temperature: float = Field(0.1, gt=0)


class ClipConfig(Strict):
    """Image tower against a frozen sentence-transformer's caption embeddings and a trainable projection."""

    name: Literal["clip"]
    temperature: float = Field(0.07, gt=0)
    learn_temperature: bool = True
    text_model: str | None = None
    text_hidden_dim: int | None = Field(None, gt=0, description="hidden width of the text projection; "
                                        "default: a linear projection")


class _SelfDistillationConfig(Strict):
    """A student and its EMA teacher (momentum cosine from ``teacher_momentum`` to 1) on multi-crop views."""

    student_temperature: float = Field(0.1, gt=0)
    teacher_temperature: float = Field(0.04, gt=0)
    teacher_momentum: float = Field(0.996, ge=0, le=1)


class _MaskedPatchesConfig(Strict):
    """Block masking of the student's global views for a masked-patch loss: ``mask_ratio`` is the
    range of each masked view's ratio, ``mask_share`` the share of global views masked; the teacher's
    patch distributions are sharpened with ``patch_teacher_temperature``."""

    patch_teacher_temperature: float = Field(0.07, gt=0)
    mask_ratio: tuple[float, float] = (0.1, 0.5)
    mask_share: float = Field(0.5, ge=0, le=1)


class SOPConfig(_SelfDistillationConfig, _MaskedPatchesConfig):
    """SOP: distributions over self-organizing prototypes drawn from memories of teacher outputs.

    Each step ``num_anchors`` anchors (at most the filled entries) with ``support_size`` nearest
    neighbors each; ``one_hot`` labels instead of the soft ones; ``fixed_anchors``: draw the anchors
    once, when the memory is full, and keep them (an ablation), and with ``fixed_supports`` their
    supports of that draw too (the SOPs fixed after the initial selection, as the paper words the
    ablation); ``shared_supports: false``: a memory entry supports one SOP at most (the non-shared
    ablation). ``cls_weight`` λ1 and ``mim_weight``
    λ2 (0: no masking, no MIM) weight the [CLS] and the masked-patch losses; ``koleo_weight`` > 0
    adds that times the KoLeo loss of the student's global [CLS] embeddings (an option, not the paper's
    SOP). ``patches_per_view`` teacher patch tokens of each global view enter the patch memory per step.
    """

    name: Literal["sop"]
    num_anchors: int = Field(4096, gt=1)
    support_size: int = Field(8, gt=0)
    epsilon: float = Field(0.1, ge=0, lt=1)
    one_hot: bool = False
    fixed_anchors: bool = False
    fixed_supports: bool = False
    shared_supports: bool = True
    cls_memory: int = Field(65536, gt=1)
    patch_memory: int = Field(8192, gt=1)
    patches_per_view: int = Field(1, gt=0)
    cls_weight: float = Field(1.0, ge=0)
    mim_weight: float = Field(1.0, ge=0)
    koleo_weight: float = Field(0.0, ge=0)

    @model_validator(mode="after")
    def _supports_fixed_with_their_anchors(self) -> SOPConfig:
        if self.fixed_supports and not self.fixed_anchors:
            raise ValueError("fixed_supports keeps the supports of fixed anchors; set fixed_anchors=true too")
        return self


class DinoConfig(_SelfDistillationConfig):
    """The DINO-style baseline: ``num_prototypes`` learnable prototypes (a weight-normalised last
    layer), the teacher centred by an EMA of momentum ``center_momentum`` and sharpened.

    DINO's stabilisers, scaled to the run: the prototypes stay frozen for the first
    ``freeze_prototypes`` share of the steps (DINO's ``freeze_last_layer``, 1 epoch of 100), and the
    teacher temperature warms up linearly from ``teacher_temperature`` to ``final_teacher_temperature``
    over the first ``teacher_warmup`` share (0.04 to 0.07 over 30 epochs of 100)."""

    name: Literal["dino"]
    num_prototypes: int = Field(4096, gt=1)
    center_momentum: float = Field(0.9, ge=0, lt=1)
    freeze_prototypes: float = Field(0.01, ge=0, lt=1)
    final_teacher_temperature: float = Field(0.07, gt=0)
    teacher_warmup: float = Field(0.3, ge=0, le=1)


class IBOTConfig(DinoConfig, _MaskedPatchesConfig):
    """The iBOT-style baseline: DINO plus a masked-patch loss of weight ``patch_weight`` over the same
    prototypes, its teacher centred apart from the [CLS] one and its temperature warmed up as the
    [CLS] one, from ``teacher_temperature`` to ``patch_teacher_temperature``."""

    name: Literal["ibot"]  # type: ignore[assignment]
    patch_weight: float = Field(1.0, gt=0)


MethodConfig = Annotated[XCLRConfig | SimCLRConfig | SupConConfig | ClipConfig | SOPConfig | DinoConfig
                         | IBOTConfig,
                         Field(discriminator="name")]  # the shipped methods; accept_method adds others


class Config(Strict):
    """One training experiment."""

    method: MethodConfig
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = ModelConfig()
    optim: OptimConfig = OptimConfig()
    monitor: MonitorConfig = MonitorConfig()


def accept_method(name: str, settings: type[BaseModel]) -> None:
    """Let ``method.name: <name>`` validate into ``settings``, a model whose ``name`` is
    ``Literal["<name>"]``: how a method outside the library (see :func:`repsim.methods.base.register`) has its
    settings read, and their errors described, like a shipped method's. Settings accepted under the
    same name before are replaced."""
    if _name_of(settings) != name:
        raise TypeError(f"the settings of method {name!r} must be a model with name: Literal[{name!r}]")
    field = Config.model_fields["method"]
    others = [model for model in get_args(field.annotation) if _name_of(model) != name]
    field.annotation = Union[(*others, settings)]  # the field keeps its discriminator
    Config.model_rebuild(force=True)


def shipped() -> tuple[str, ...]:
    """The method names the library ships (``method.name``), in its order."""
    union, _ = get_args(MethodConfig)
    return tuple(_name_of(model) for model in get_args(union))


def accepted_methods() -> tuple[str, ...]:
    """The method names a config accepts now: those shipped, then those accepted from outside."""
    return tuple(_name_of(model) for model in get_args(Config.model_fields["method"].annotation))


def import_outside_method(name: str) -> None:
    """Import the module that a package names for method ``name`` under the entry-point group
    ``repsim.methods``, so that it registers itself (and its settings); nothing when none does.
    SpecError in one line when that module does not import."""
    for point in entry_points(group=ENTRY_POINTS, name=name):
        try:
            point.load()
        except Exception as err:  # whatever the outside module raises while it imports
            raise SpecError(f"method {name!r} of {point.value!r} (entry point of {point.dist.name if point.dist else '?'}) "
                            f"does not import: {first_line(err)}", "fix or reinstall the package") from None


def _name_of(settings: type[BaseModel]) -> str | None:
    """The method a settings model is for: ``x`` of its field ``name: Literal["x"]``."""
    field = settings.model_fields.get("name")
    tags = get_args(field.annotation) if field is not None else ()
    return tags[0] if len(tags) == 1 else None


# ---------------------------------------------------------------------------------------------
# Loading

def load_config(path: str | Path, overrides: Sequence[str] = (), schema: type[BaseModel] = Config) -> Any:
    """Read the config at ``path`` (or the shipped config of that name) and apply ``overrides``
    (``"optim.lr=0.01"``), as a ``schema`` (default: a training :class:`Config`) whose defaults fill
    in the rest. Raises SpecError in one line naming file and field."""
    return load_model(schema, path, CONFIG_FILE, overrides, prepare=_import_method if schema is Config else None)


def _import_method(values: dict[str, Any]) -> None:
    """Import the outside method that ``method.name`` names, if no method of that name is accepted yet."""
    method = values.get("method")
    if isinstance(method, dict) and method.get("name") not in accepted_methods():
        import_outside_method(str(method.get("name")))
