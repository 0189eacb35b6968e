//! The tensor element types pdmesh reads (GGML's type ids, block shapes and
//! names): one home for that vocabulary, used by the GGUF reader, the
//! matmuls and the error messages.

use crate::kquant::*;
use crate::matmul::QData;
use crate::quant::{cast_blocks, dequantize_q4_1, dequantize_q8_0};

/// GGML tensor element types this engine can read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TensorType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
}

/// GGML's names for its type ids (ggml.h), for error messages about types
/// pdmesh does not read.
const GGML_NAMES: [&str; 42] = [
    "F32",
    "F16",
    "Q4_0",
    "Q4_1",
    "Q4_2",
    "Q4_3",
    "Q5_0",
    "Q5_1",
    "Q8_0",
    "Q8_1",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "Q8_K",
    "IQ2_XXS",
    "IQ2_XS",
    "IQ3_XXS",
    "IQ1_S",
    "IQ4_NL",
    "IQ3_S",
    "IQ2_S",
    "IQ4_XS",
    "I8",
    "I16",
    "I32",
    "I64",
    "F64",
    "IQ1_M",
    "BF16",
    "Q4_0_4_4",
    "Q4_0_4_8",
    "Q4_0_8_8",
    "TQ1_0",
    "TQ2_0",
    "IQ4_NL_4_4",
    "IQ4_NL_4_8",
    "IQ4_NL_8_8",
    "MXFP4",
    "NVFP4",
    "Q1_0",
];

/// Every type, for tables and tests.
pub const ALL: [TensorType; 12] = [
    TensorType::F32,
    TensorType::F16,
    TensorType::Q4_0,
    TensorType::Q4_1,
    TensorType::Q5_0,
    TensorType::Q5_1,
    TensorType::Q8_0,
    TensorType::Q2K,
    TensorType::Q3K,
    TensorType::Q4K,
    TensorType::Q5K,
    TensorType::Q6K,
];

impl TensorType {
    /// GGML's type id.
    pub fn ggml_id(self) -> u32 {
        match self {
            TensorType::F32 => 0,
            TensorType::F16 => 1,
            TensorType::Q4_0 => 2,
            TensorType::Q4_1 => 3,
            TensorType::Q5_0 => 6,
            TensorType::Q5_1 => 7,
            TensorType::Q8_0 => 8,
            TensorType::Q2K => 10,
            TensorType::Q3K => 11,
            TensorType::Q4K => 12,
            TensorType::Q5K => 13,
            TensorType::Q6K => 14,
        }
    }

    pub fn from_ggml_id(id: u32) -> Option<TensorType> {
        ALL.into_iter().find(|t| t.ggml_id() == id)
    }

    /// GGML's name of a type id, known to pdmesh or not ("type 99" if GGML
    /// has none).
    pub fn ggml_name(id: u32) -> String {
        GGML_NAMES.get(id as usize).map(|s| s.to_string()).unwrap_or_else(|| format!("type {id}"))
    }

    pub fn name(self) -> &'static str {
        GGML_NAMES[self.ggml_id() as usize]
    }

    /// (elements per block, bytes per block).
    pub fn block(self) -> (u64, u64) {
        match self {
            TensorType::F32 => (1, 4),
            TensorType::F16 => (1, 2),
            TensorType::Q4_0 => (32, 18),
            TensorType::Q4_1 => (32, 20),
            TensorType::Q5_0 => (32, 22),
            TensorType::Q5_1 => (32, 24),
            TensorType::Q8_0 => (32, 34),
            TensorType::Q2K => (256, 84),
            TensorType::Q3K => (256, 110),
            TensorType::Q4K => (256, 144),
            TensorType::Q5K => (256, 176),
            TensorType::Q6K => (256, 210),
        }
    }

    /// Whether the matmuls take this type as a weight.
    pub fn is_matmul_weight(self) -> bool {
        !matches!(QData::from_bytes(self, &[]), Err(WeightError::Unsupported(_)))
    }
}

impl std::fmt::Display for TensorType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Why bytes cannot be a matmul weight.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WeightError {
    /// The matmuls do not take this type.
    Unsupported(TensorType),
    /// Not a whole number of blocks, or misaligned for the block type.
    Misaligned,
}

impl<'a> QData<'a> {
    /// View a tensor's raw bytes as blocks of its type.
    pub fn from_bytes(ty: TensorType, bytes: &'a [u8]) -> Result<QData<'a>, WeightError> {
        let cast = |o: Option<QData<'a>>| o.ok_or(WeightError::Misaligned);
        match ty {
            TensorType::Q4_1 => cast(cast_blocks(bytes).map(QData::Q4_1)),
            TensorType::Q8_0 => cast(cast_blocks(bytes).map(QData::Q8_0)),
            TensorType::Q5_0 => cast(cast_blocks(bytes).map(QData::Q5_0)),
            TensorType::Q5_1 => cast(cast_blocks(bytes).map(QData::Q5_1)),
            TensorType::Q2K => cast(cast_blocks(bytes).map(QData::Q2K)),
            TensorType::Q3K => cast(cast_blocks(bytes).map(QData::Q3K)),
            TensorType::Q4K => cast(cast_blocks(bytes).map(QData::Q4K)),
            TensorType::Q5K => cast(cast_blocks(bytes).map(QData::Q5K)),
            TensorType::Q6K => cast(cast_blocks(bytes).map(QData::Q6K)),
            other => Err(WeightError::Unsupported(other)),
        }
    }

    /// Dequantize blocks `first..first + out.len() / block_len` to f32.
    pub fn dequantize(&self, first: usize, out: &mut [f32]) {
        macro_rules! run {
            ($f:path, $b:expr, $len:expr) => {{
                let n = out.len() / $len;
                $f(&$b[first..first + n], out)
            }};
        }
        match *self {
            QData::Q4_1(b) => run!(dequantize_q4_1, b, 32),
            QData::Q8_0(b) => run!(dequantize_q8_0, b, 32),
            QData::Q5_0(b) => run!(dequantize_q5_0, b, 32),
            QData::Q5_1(b) => run!(dequantize_q5_1, b, 32),
            QData::Q2K(b) => run!(dequantize_q2_k, b, QK_K),
            QData::Q3K(b) => run!(dequantize_q3_k, b, QK_K),
            QData::Q4K(b) => run!(dequantize_q4_k, b, QK_K),
            QData::Q5K(b) => run!(dequantize_q5_k, b, QK_K),
            QData::Q6K(b) => run!(dequantize_q6_k, b, QK_K),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{BlockQ4_1, BlockQ8_0};

    #[test]
    fn block_table_matches_the_structs() {
        use std::mem::size_of;
        let sizes = [
            (TensorType::Q4_1, size_of::<BlockQ4_1>()),
            (TensorType::Q8_0, size_of::<BlockQ8_0>()),
            (TensorType::Q5_0, size_of::<BlockQ5_0>()),
            (TensorType::Q5_1, size_of::<BlockQ5_1>()),
            (TensorType::Q2K, size_of::<BlockQ2K>()),
            (TensorType::Q3K, size_of::<BlockQ3K>()),
            (TensorType::Q4K, size_of::<BlockQ4K>()),
            (TensorType::Q5K, size_of::<BlockQ5K>()),
            (TensorType::Q6K, size_of::<BlockQ6K>()),
        ];
        for (t, s) in sizes {
            assert_eq!(t.block().1 as usize, s, "{t}");
            assert_eq!(TensorType::from_ggml_id(t.ggml_id()), Some(t));
        }
        assert_eq!(TensorType::ggml_name(16), "IQ2_XXS");
        assert_eq!(TensorType::Q4K.name(), "Q4_K");
        assert!(!TensorType::F32.is_matmul_weight() && TensorType::Q6K.is_matmul_weight());
    }
}
