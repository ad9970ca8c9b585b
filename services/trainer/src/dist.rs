//! The trainer's process group: one rank alone ([`Comm::Solo`], collectives are the identity) or
//! `trainer.n_gpus_per_node × trainer.nnodes` ranks in one c10d process group (Gloo on the CPU, NCCL on CUDA,
//! through `jetrl-torch-ext`). Every collective of the learner goes through [`Comm`], so the learner's code is the
//! same for one rank and for many; nothing home-made carries tensors between ranks.

use std::sync::{Arc, Mutex, MutexGuard};

use jetrl_torch_ext::{DistError, ProcessGroup, ReduceOp};
use tch::{Device, Kind, Tensor};

/// This rank's view of the trainer's ranks.
#[derive(Clone, Default)]
pub enum Comm {
    /// one rank: every collective is the identity
    #[default]
    Solo,
    /// a c10d process group (the actor thread is its only user; the mutex makes the handle shareable between the
    /// actor's and the critic's optimizers)
    Group(Arc<Mutex<ProcessGroup>>),
}

impl std::fmt::Debug for Comm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Comm(rank {} of {})", self.rank(), self.world())
    }
}

impl Comm {
    pub fn group(group: ProcessGroup) -> Self {
        Self::Group(Arc::new(Mutex::new(group)))
    }

    fn lock(group: &Arc<Mutex<ProcessGroup>>) -> MutexGuard<'_, ProcessGroup> {
        // a panic while holding the group poisons nothing the group itself keeps: the C++ side is consistent
        group.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn rank(&self) -> usize {
        match self {
            Self::Solo => 0,
            Self::Group(g) => Self::lock(g).rank(),
        }
    }

    pub fn world(&self) -> usize {
        match self {
            Self::Solo => 1,
            Self::Group(g) => Self::lock(g).world_size(),
        }
    }

    /// Sums `tensor` over the ranks, in place.
    pub fn all_reduce_sum(&self, tensor: &mut Tensor) -> Result<(), DistError> {
        match self {
            Self::Solo => Ok(()),
            Self::Group(g) => Self::lock(g).all_reduce(tensor, ReduceOp::Sum),
        }
    }

    /// Sums `input` (`world × out.numel()` elements) over the ranks and leaves this rank's slice in `out`.
    pub fn reduce_scatter_sum(&self, out: &mut Tensor, input: &Tensor) -> Result<(), DistError> {
        match self {
            Self::Solo => out.f_copy_(&input.f_view_as(out).map_err(torch_error)?).map_err(torch_error),
            Self::Group(g) => Self::lock(g).reduce_scatter(out, input, ReduceOp::Sum),
        }
    }

    /// Every rank's `input`, rank after rank, into `out` (`world × input.numel()` elements).
    pub fn all_gather(&self, out: &mut Tensor, input: &Tensor) -> Result<(), DistError> {
        match self {
            Self::Solo => out.f_copy_(&input.f_view_as(out).map_err(torch_error)?).map_err(torch_error),
            Self::Group(g) => Self::lock(g).all_gather_into(out, input),
        }
    }

    /// Sums host numbers over the ranks (one collective for all of them), in f64.
    pub fn all_reduce_f64(&self, values: &mut [f64], device: Device) -> Result<(), DistError> {
        if matches!(self, Self::Solo) || values.is_empty() {
            return Ok(());
        }
        let mut t = Tensor::f_from_slice(values).and_then(|t| t.f_to_device(device)).map_err(torch_error)?;
        self.all_reduce_sum(&mut t)?;
        let summed = t.f_to_device(Device::Cpu).and_then(|t| Vec::<f64>::try_from(&t)).map_err(torch_error)?;
        values.copy_from_slice(&summed);
        Ok(())
    }

    /// Sums a host matrix over the ranks (moved to `device` for the collective: NCCL reduces device memory).
    pub fn all_reduce_f32(&self, values: &mut [f32], device: Device) -> Result<(), DistError> {
        if matches!(self, Self::Solo) || values.is_empty() {
            return Ok(());
        }
        let mut t = Tensor::f_from_slice(values).and_then(|t| t.f_to_device(device)).map_err(torch_error)?;
        self.all_reduce_sum(&mut t)?;
        let summed = t.f_to_device(Device::Cpu).and_then(|t| Vec::<f32>::try_from(&t)).map_err(torch_error)?;
        values.copy_from_slice(&summed);
        Ok(())
    }

    /// Every rank's bytes (rank-major), through two all-gathers: the lengths, then the bytes padded to the longest.
    pub fn all_gather_bytes(&self, bytes: &[u8], device: Device) -> Result<Vec<Vec<u8>>, DistError> {
        let world = self.world();
        if world == 1 {
            return Ok(vec![bytes.to_vec()]);
        }
        let len =
            Tensor::f_from_slice(&[bytes.len() as i64]).and_then(|t| t.f_to_device(device)).map_err(torch_error)?;
        let mut lens = Tensor::f_zeros([world as i64], (Kind::Int64, device)).map_err(torch_error)?;
        self.all_gather(&mut lens, &len)?;
        let lens: Vec<i64> =
            lens.f_to_device(Device::Cpu).and_then(|t| Vec::<i64>::try_from(&t)).map_err(torch_error)?;
        let longest = lens.iter().copied().max().unwrap_or(0).max(1);
        let mut padded = bytes.to_vec();
        padded.resize(longest as usize, 0);
        let mine = Tensor::f_from_slice(&padded).and_then(|t| t.f_to_device(device)).map_err(torch_error)?;
        let mut all = Tensor::f_zeros([world as i64 * longest], (Kind::Uint8, device)).map_err(torch_error)?;
        self.all_gather(&mut all, &mine)?;
        let all: Vec<u8> = all.f_to_device(Device::Cpu).and_then(|t| Vec::<u8>::try_from(&t)).map_err(torch_error)?;
        Ok(lens
            .iter()
            .enumerate()
            .map(|(r, &n)| all[r * longest as usize..r * longest as usize + n as usize].to_vec())
            .collect())
    }

    /// Writes `value` under `key` in the group's store (nothing with one rank).
    pub fn store_set(&self, key: &str, value: &[u8]) -> Result<(), DistError> {
        match self {
            Self::Solo => Ok(()),
            Self::Group(g) => Self::lock(g).store_set(key, value),
        }
    }

    /// The value under `key` in the group's store once it exists, waiting up to `wait` (`None` after that, and
    /// always with one rank).
    pub fn store_get(&self, key: &str, wait: std::time::Duration) -> Result<Option<Vec<u8>>, DistError> {
        match self {
            Self::Solo => Ok(None),
            Self::Group(g) => Self::lock(g).store_get(key, wait),
        }
    }

    /// Deletes `key` from the group's store (nothing with one rank).
    pub fn store_delete(&self, key: &str) -> Result<(), DistError> {
        match self {
            Self::Solo => Ok(()),
            Self::Group(g) => Self::lock(g).store_delete(key),
        }
    }

    /// Returns once every rank has reached it.
    pub fn barrier(&self) -> Result<(), DistError> {
        match self {
            Self::Solo => Ok(()),
            Self::Group(g) => Self::lock(g).barrier(),
        }
    }
}

/// A tensor operation around a collective failed (a shape or device mismatch of our own making).
fn torch_error(err: tch::TchError) -> DistError {
    DistError::InvalidArgument { op: "tensor", rank: 0, message: err.to_string() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_solo_rank_reduces_and_gathers_to_itself() {
        let comm = Comm::Solo;
        let input = Tensor::from_slice(&[1.0f32, 2.0, 3.0]);
        let mut out = Tensor::zeros([3], (Kind::Float, Device::Cpu));
        comm.reduce_scatter_sum(&mut out, &input).unwrap();
        assert_eq!(Vec::<f32>::try_from(&out).unwrap(), vec![1.0, 2.0, 3.0]);
        let mut values = [1.5, 2.5];
        comm.all_reduce_f64(&mut values, Device::Cpu).unwrap();
        assert_eq!(values, [1.5, 2.5]);
        assert_eq!(comm.all_gather_bytes(b"abc", Device::Cpu).unwrap(), vec![b"abc".to_vec()]);
        assert_eq!((comm.rank(), comm.world()), (0, 1));
    }
}
