"""Tagged variants, the pydantic way: a setting that picks one of several shapes (ROLLOUTS, TRAIN_MODE), each shape
carrying the knobs only it reads. `.env` stays flat (ROLLOUTS, MAX_STALENESS, ...); RunConfig reads the flat names and
builds the variant once: each variant's fields are named as the flat settings it takes, which is the one mapping."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError


class Variant(BaseModel):
    """One choice of a mode setting, frozen once read. `name` (its discriminator) is its value in .env; its other fields
    are its own knobs."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    setting: ClassVar[str]  # the .env variable that chooses it

    name: str

    def __str__(self) -> str:
        return self.name

    @classmethod
    def knobs(cls) -> tuple[str, ...]:
        """The flat settings it carries (RunConfig field names)."""
        return tuple(name for name in cls.model_fields if name != "name")

    @classmethod
    def tag(cls) -> str:
        return cls.model_fields["name"].default


def choices(members: tuple[type[Variant], ...]) -> dict[str, type[Variant]]:
    return {cls.tag(): cls for cls in members}


def build(adapter: TypeAdapter, members: tuple[type[Variant], ...], name: str, flat: dict[str, Any]) -> Any:
    """The variant `name` names, with the knobs it owns taken from the flat settings; ValueError (one line) for a name
    no variant has."""
    by_name = choices(members)
    if name not in by_name:
        raise ValueError(f"{members[0].setting}={name!r}: choose from {', '.join(by_name)} (edit .env)")
    cls = by_name[name]
    try:
        return adapter.validate_python({"name": name, **{k: flat[k] for k in cls.knobs() if k in flat}})
    except ValidationError as exc:
        raise ValueError(f"{cls.setting}={name}: {exc.errors()[0]['msg']} (edit .env)") from None


def foreign_knob(members: tuple[type[Variant], ...], name: str, flat: dict[str, Any],
                 defaults: dict[str, Any]) -> str | None:
    """One line when a knob of a variant other than `name` is set to other than its default (it would be ignored
    without a word), else None."""
    cls = choices(members)[name]
    for other in members:
        for knob in other.knobs():
            if knob not in cls.knobs() and flat.get(knob, defaults[knob]) != defaults[knob]:
                return (f"{knob.upper()}={flat[knob]} is a setting of {other.setting}={other.tag()}, which this run "
                        f"does not use ({cls.setting}={cls.tag()}): set {other.setting}={other.tag()}, or leave "
                        f"{knob.upper()} empty (edit .env)")
    return None
