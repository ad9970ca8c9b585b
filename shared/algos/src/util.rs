//! Small tensor helpers shared by the modules: input validation (so later ops cannot panic on shapes or
//! devices) and host read-back.

use tch::{Device, Kind, Tensor};

/// Checks that every named tensor is 2-D `[batch, response_len]` with the shape and device of the first.
/// Returns the message to wrap into the caller's stage error.
pub(crate) fn check_same_2d(named: &[(&str, &Tensor)]) -> Result<(i64, i64), String> {
    let Some((first_name, first)) = named.first() else {
        return Ok((0, 0));
    };
    let shape = first.size();
    if shape.len() != 2 {
        return Err(format!("{first_name} must be [batch, response_len], got shape {shape:?}"));
    }
    check_float(first_name, first)?;
    let device = first.device();
    for (name, tensor) in &named[1..] {
        if tensor.size() != shape {
            return Err(format!("{name} has shape {:?} but {first_name} has {shape:?}", tensor.size()));
        }
        if tensor.device() != device {
            return Err(format!("{name} is on {:?} but {first_name} is on {device:?}", tensor.device()));
        }
    }
    Ok((shape[0], shape[1]))
}

/// Checks that a tensor holds floating-point values (the RL math is defined on floats).
pub(crate) fn check_float(name: &str, tensor: &Tensor) -> Result<(), String> {
    match tensor.kind() {
        Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16 => Ok(()),
        other => Err(format!("{name} must be a floating-point tensor, got {other:?}")),
    }
}

/// Checks a 1-D per-row tensor `[batch]`.
pub(crate) fn check_rows(name: &str, tensor: &Tensor, batch: i64, device: Device) -> Result<(), String> {
    if tensor.size() != [batch] {
        return Err(format!("{name} must have shape [{batch}], got {:?}", tensor.size()));
    }
    if tensor.device() != device {
        return Err(format!("{name} is on {:?}, expected {device:?}", tensor.device()));
    }
    Ok(())
}

/// The value of a one-element tensor as f64 (NaN if it cannot be read, which only a bug can cause).
pub(crate) fn item(tensor: &Tensor) -> f64 {
    tensor.f_double_value(&[]).unwrap_or(f64::NAN)
}

/// Copies a tensor of any shape to the host as a flat `Vec<f64>` (row-major).
pub(crate) fn to_vec_f64(tensor: &Tensor) -> Result<Vec<f64>, tch::TchError> {
    let flat = tensor.f_detach()?.f_to_kind(Kind::Double)?.f_to_device(Device::Cpu)?.f_reshape([-1])?;
    Vec::<f64>::try_from(&flat)
}

/// A mask as floating-point weights of the given kind (verl multiplies by the mask after `where(mask.bool())`).
pub(crate) fn mask_like(mask: &Tensor, like: &Tensor) -> Tensor {
    if mask.kind() == like.kind() {
        mask.shallow_clone()
    } else {
        mask.to_kind(like.kind())
    }
}

/// Sum over the last dimension.
pub(crate) fn sum_last(tensor: &Tensor) -> Tensor {
    tensor.sum_dim_intlist(-1, false, None::<Kind>)
}

/// Sum of every element.
pub(crate) fn sum_all(tensor: &Tensor) -> Tensor {
    tensor.sum(None::<Kind>)
}
