//! GPU memory for `pdmesh-bench kv --vram`: a buffer on GPU 0 that NIXL
//! registers as VRAM, and the device-to-device copy a transfer is held up
//! against. A machine without a CUDA driver gets an error, never a panic.

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};
use pdmesh_engine::TransferArena;

pub struct VramBuf {
    stream: Arc<CudaStream>,
    buf: CudaSlice<u8>,
}

fn cuda<T>(what: &str, r: Result<T, cudarc::driver::DriverError>) -> Result<T, String> {
    r.map_err(|e| format!("{what}: {:?}", e.0))
}

impl VramBuf {
    /// `n` bytes on GPU 0: `fill`'s bytes, else zeros.
    pub fn new(n: usize, fill: Option<&[u8]>) -> Result<VramBuf, String> {
        if !pdmesh_cuda::gpu::driver_present() {
            return Err("--vram needs a GPU: no CUDA driver (libcuda.so) on this machine".into());
        }
        let ctx = cuda("creating the CUDA context", CudaContext::new(0))?;
        let stream = cuda("creating a stream", ctx.new_stream())?;
        let buf = match fill {
            Some(bytes) => cuda("copying to the GPU", stream.clone_htod(&bytes[..n]))?,
            None => cuda("allocating GPU memory", stream.alloc_zeros::<u8>(n))?,
        };
        cuda("synchronizing", stream.synchronize())?;
        Ok(VramBuf { stream, buf })
    }

    /// The buffer as NIXL registers it (VRAM of GPU 0).
    pub fn arena(&self) -> TransferArena {
        let (ptr, _sync) = self.buf.device_ptr(&self.stream);
        TransferArena { addr: ptr as usize, len: self.buf.len(), gpu: Some(0) }
    }

    /// Seconds of each of `rounds` copies of the buffer into another on the same GPU.
    pub fn d2d_times(&self, rounds: usize) -> Result<Vec<f64>, String> {
        let mut dst = cuda("allocating GPU memory", self.stream.alloc_zeros::<u8>(self.buf.len()))?;
        let mut t = Vec::with_capacity(rounds);
        for _ in 0..rounds {
            let t0 = Instant::now();
            cuda("copying on the GPU", self.stream.memcpy_dtod(&self.buf, &mut dst))?;
            cuda("synchronizing", self.stream.synchronize())?;
            t.push(t0.elapsed().as_secs_f64());
        }
        Ok(t)
    }

    /// The buffer's bytes, on the host (to check what a transfer wrote).
    pub fn read(&self) -> Result<Vec<u8>, String> {
        cuda("copying from the GPU", self.stream.clone_dtoh(&self.buf))
    }
}
