//! `.npy` input and output for `ladder run`: float16, float32 or float64 tensors.

use std::fs::File;
use std::io::{self, BufReader, BufWriter};
use std::path::{Path, PathBuf};

use half::f16;
use ndarray::{Array4, ArrayBase, ArrayD, Data, Dimension, IxDyn, ShapeBuilder};
use npyz::{TypeChar, WriterBuilder};
use thiserror::Error;

/// The element types `ladder run` reads and writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum DType {
    F16,
    F32,
    F64,
}

/// A `[batch, heads, seq, head_dim]` tensor read from a `.npy` file, widened (exactly) to `f64`.
#[derive(Debug, Clone)]
pub struct NpyTensor {
    pub dtype: DType,
    pub data: Array4<f64>,
}

/// Why a `.npy` file could not be used; each names the file.
#[derive(Debug, Error)]
pub enum NpyError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("{path}: dtype {dtype} is not supported (expected float16, float32 or float64)")]
    DType { path: PathBuf, dtype: String },
    #[error("{path}: expected 4 dimensions [batch, heads, seq, head_dim], found {} ({shape:?})", shape.len())]
    Rank { path: PathBuf, shape: Vec<u64> },
    #[error("{path}: has a zero-sized dimension {shape:?}")]
    Empty { path: PathBuf, shape: Vec<u64> },
}

/// Reads a float16/32/64 `.npy` file of rank 4 (C or Fortran order).
pub fn read(path: &Path) -> Result<NpyTensor, NpyError> {
    let (dtype, data) = read_any(path)?;
    let shape: Vec<u64> = data.shape().iter().map(|&x| x as u64).collect();
    let data =
        data.into_dimensionality().map_err(|_| NpyError::Rank { path: path.to_owned(), shape })?;
    Ok(NpyTensor { dtype, data })
}

/// Reads a float16/32/64 `.npy` file of any rank, widened to `f64`.
pub fn read_any(path: &Path) -> Result<(DType, ArrayD<f64>), NpyError> {
    let io_err = |source| NpyError::Io { path: path.to_owned(), source };
    let file = File::open(path).map_err(io_err)?;
    let npy = npyz::NpyFile::new(BufReader::new(file)).map_err(io_err)?;
    let shape = npy.shape().to_vec();
    let dtype = match npy.dtype() {
        npyz::DType::Plain(ts) if ts.type_char() == TypeChar::Float => match ts.size_field() {
            2 => DType::F16,
            4 => DType::F32,
            8 => DType::F64,
            _ => return Err(NpyError::DType { path: path.to_owned(), dtype: ts.to_string() }),
        },
        other => return Err(NpyError::DType { path: path.to_owned(), dtype: other.descr() }),
    };
    if shape.contains(&0) {
        return Err(NpyError::Empty { path: path.to_owned(), shape });
    }
    let fortran = npy.order() == npyz::Order::Fortran;
    let data: Vec<f64> = match dtype {
        DType::F16 => npy.into_vec::<f16>().map_err(io_err)?.into_iter().map(f64::from).collect(),
        DType::F32 => npy.into_vec::<f32>().map_err(io_err)?.into_iter().map(f64::from).collect(),
        DType::F64 => npy.into_vec::<f64>().map_err(io_err)?,
    };
    let dims: Vec<usize> = shape.iter().map(|&x| x as usize).collect();
    let array = ArrayD::from_shape_vec(IxDyn(&dims).set_f(fortran), data)
        .map_err(|e| io_err(io::Error::new(io::ErrorKind::InvalidData, e)))?;
    Ok((dtype, array))
}

/// Writes `array` (any layout) as a C-order `.npy` file of element type `dtype`.
pub fn write<S, D>(path: &Path, array: &ArrayBase<S, D>, dtype: DType) -> Result<(), NpyError>
where
    S: Data<Elem = f64>,
    D: Dimension,
{
    let io_err = |source| NpyError::Io { path: path.to_owned(), source };
    let shape: Vec<u64> = array.shape().iter().map(|&x| x as u64).collect();
    let file = BufWriter::new(File::create(path).map_err(io_err)?);
    fn put<T: npyz::AutoSerialize>(
        file: BufWriter<File>,
        shape: &[u64],
        items: impl Iterator<Item = T>,
    ) -> io::Result<()> {
        let mut writer =
            npyz::WriteOptions::new().default_dtype().shape(shape).writer(file).begin_nd()?;
        writer.extend(items)?;
        writer.finish()
    }
    match dtype {
        DType::F16 => put(file, &shape, array.iter().map(|&x| f16::from_f64(x))),
        DType::F32 => put(file, &shape, array.iter().map(|&x| x as f32)),
        DType::F64 => put(file, &shape, array.iter().copied()),
    }
    .map_err(io_err)
}
