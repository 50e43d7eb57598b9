//! Internals that tests outside the crate (tests/, the GPU suite) drive directly; not an
//! interface of the library, and hidden from its documentation.

/// The InfiniBand verbs interface, for a software model of a fabric, and the hook that
/// installs one.
pub mod ib {
    pub use crate::transport::net::ib::set_provider;
    pub use crate::transport::net::ib::verbs::*;
    /// Host memory that windows register with the InfiniBand device through a dmabuf, as
    /// they do device memory (a memfd stands in for a GPU's export).
    pub use crate::window::gdr::{forget_stand_in, stand_in};
}

/// The CUDA driver layer, for the device-memory suite.
pub mod cuda {
    pub use crate::cuda::{
        copy_from_device, copy_to_device, device_count, Device, DeviceMem, Event, Graph, Stream,
    };
}

/// The cost model behind ncclGroupSimulateEnd, asked about layouts no machine here can start
/// (examples/cost_model.rs).
pub mod cost {
    pub use crate::algo::cost::{synthetic, Fabric, Link, Prediction};
}
