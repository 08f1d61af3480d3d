"""Which model layers each pipeline stage holds."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class PipelineSplit:
    """The model layers of each pipeline stage: consecutive, non-empty ranges that cover
    [0, num_layers) in order.

    Attributes:
      stages: Stage s holds the layers `stages[s]` ([a, b)).
    """

    stages: tuple[range, ...]

    def __post_init__(self):
        if not self.stages:
            raise ValueError("a pipeline split needs at least one stage; got none")
        start = 0
        for index, layers in enumerate(self.stages):
            if not isinstance(layers, range) or layers.step != 1 or layers.start != start:
                raise ValueError(
                    f"pipeline stages hold consecutive layer ranges from layer 0; stage {index} "
                    f"holds {layers}, expected a range starting at layer {start}"
                )
            if not layers:
                raise ValueError(
                    f"every pipeline stage holds at least one layer; stage {index} holds none "
                    f"({layers}). Use fewer stages or move a layer to it"
                )
            start = layers.stop

    @property
    def pp(self) -> int:
        """The number of stages."""
        return len(self.stages)

    @property
    def num_layers(self) -> int:
        """The model's layer count (the layers the stages cover)."""
        return self.stages[-1].stop

    @property
    def sizes(self) -> tuple[int, ...]:
        """Layers per stage."""
        return tuple(len(layers) for layers in self.stages)

    @classmethod
    def of_sizes(cls, sizes: Sequence[int], num_layers: int) -> PipelineSplit:
        """The split whose stage s holds `sizes[s]` layers.

        Raises:
          ValueError: A size is not positive (a stage with no layer), or the sizes do not add
            up to `num_layers`.
        """
        sizes = tuple(sizes)
        empty = [index for index, size in enumerate(sizes) if size < 1]
        if empty:
            raise ValueError(
                f"every pipeline stage holds at least one layer; got {list(sizes)}, where stage "
                f"{empty[0]} holds {sizes[empty[0]]}"
            )
        if sum(sizes) != num_layers:
            raise ValueError(
                f"a pipeline split must cover the model's {num_layers} layers exactly; got "
                f"{list(sizes)}, which add up to {sum(sizes)}"
            )
        bounds = [0]
        for size in sizes:
            bounds.append(bounds[-1] + size)
        return cls(tuple(range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)))

    @classmethod
    def balanced(cls, num_layers: int, pp: int) -> PipelineSplit:
        """`pp` stages whose sizes differ by at most one layer, the earlier stages holding the
        extra layers (as SGLang's and vLLM's default pipeline partitions do): 3 layers over 2
        stages are [2, 1], 5 over 4 are [2, 1, 1, 1].

        Raises:
          ValueError: `pp` is not positive or exceeds `num_layers` (a stage would hold none).
        """
        if pp < 1 or num_layers < pp:
            raise ValueError(
                f"{pp} pipeline stages need at least {pp} layers (one per stage); the model has "
                f"{num_layers}. Use at most {num_layers} stages"
            )
        base, extra = divmod(num_layers, pp)
        return cls.of_sizes([base + (index < extra) for index in range(pp)], num_layers)
