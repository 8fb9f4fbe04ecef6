"""``tokenswift ablate``: sweep a grid of component choices (see :mod:`tokenswift.tools.ablate`)."""

from __future__ import annotations

import sys
from pathlib import Path

from tokenswift.commands import CliError

NAME = "ablate"
HELP = "sweep a grid of component choices and parameters"


def add_arguments(parser) -> None:
    parser.add_argument("--grid", required=True, help="grid TOML (base spec, axes or cells, prompt, seeds, lengths)")
    parser.add_argument("--out", help="directory for ablation.csv/.md and plots (default: ablation-<grid name>)")
    parser.add_argument("--new-tokens", type=int, help="override the grid's new_tokens (shorter runs)")


def run(args, argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    from tokenswift.tools.ablate import Grid, run_ablation, write_reports

    grid = Grid.load(args.grid)
    if args.new_tokens is not None:
        if args.new_tokens <= 0:
            raise CliError(f"--new-tokens must be a positive integer, got {args.new_tokens}")
        import attrs

        grid = attrs.evolve(grid, new_tokens=args.new_tokens)
    out = args.out or f"ablation-{Path(args.grid).stem}"
    bar = tqdm(total=2 * len(grid.cells) * len(grid.seeds), unit="run", file=sys.stderr, dynamic_ncols=True)

    def progress(label):
        bar.set_description(label[:60], refresh=False)
        bar.update(1)

    rows = run_ablation(grid, out, progress=progress)
    bar.close()
    paths = write_reports(rows, out)
    print(paths["markdown"].read_text(), end="")
    print(f"wrote {out}/ablation.csv and {', '.join(str(p) for p in paths.values())}", file=sys.stderr)
    return 0
