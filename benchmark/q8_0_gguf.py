"""A Q8_0 copy of a GGUF file, for timing the engine's int8 weights against llama.cpp's Q8_0 ones
on the same model (bench.py --quant int8 --compare llama.cpp --gguf OUT):

    python -m benchmark.q8_0_gguf IN.gguf OUT.gguf

Every matrix is dequantized and quantized again to Q8_0 (blocks of 32 inputs, one float16 scale
each) with gguf-py, as llama.cpp's own q8_0 quantization does; the norms (vectors) and the metadata
are copied as they are. From a 4-bit file the values are the 4-bit ones up to Q8_0's rounding: a
file to time, not a better model."""

import argparse
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize

from errors import UserError, run_command
from weights.gguf_metadata import open_gguf

Q8_0 = GGMLQuantizationType.Q8_0
BLOCK = 32  # inputs per Q8_0 block


def copy_metadata(reader: GGUFReader, writer: GGUFWriter) -> None:
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue  # the writer sets these itself
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            writer.add_array(field.name, field.contents())
        else:
            writer.add_key_value(field.name, field.contents(), kind)


def requantize(source: Path, out: Path) -> None:
    reader = open_gguf(source)
    if not out.parent.is_dir():
        raise UserError(f"cannot write {out}: folder {out.parent} does not exist")
    writer = GGUFWriter(out, reader.fields["general.architecture"].contents())
    copy_metadata(reader, writer)
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists the fastest dimension first
        if len(shape) != 2 or shape[1] % BLOCK or t.tensor_type == Q8_0:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
            continue
        values = dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        writer.add_tensor(t.name, quantize(values, Q8_0), raw_dtype=Q8_0)
        print(f"{t.name}: {t.tensor_type.name} -> Q8_0", file=sys.stderr)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmark.q8_0_gguf", description=__doc__.splitlines()[0])
    p.add_argument("source", type=Path)
    p.add_argument("out", type=Path)
    args = p.parse_args(argv)
    return run_command(lambda: requantize(args.source, args.out))


if __name__ == "__main__":
    sys.exit(main())
