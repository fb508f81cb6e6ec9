#include <pybind11/stl.h>

#include "grad_handoff.h"
#include "runtime.h"

namespace py = pybind11;
using namespace streamsched;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "streamsched native runtime: per-task stream bookkeeping and fused-parameter guards, the one-call gradient hand-off";

  m.def("cuda_compiled", &cuda_compiled, "Whether this build includes the CUDA backend.");

  py::class_<TaskSync>(m, "TaskSync")
      .def(py::init([](int64_t id, int64_t stream, std::vector<int64_t> waits, bool records,
                       std::vector<int64_t> reads, std::vector<int64_t> writes,
                       std::vector<int64_t> cross_reads, std::vector<int64_t> frees) {
             return TaskSync{id, stream, std::move(waits), records, std::move(reads), std::move(writes),
                             std::move(cross_reads), std::move(frees)};
           }),
           py::arg("id"), py::arg("stream"), py::arg("waits"), py::arg("records"), py::arg("reads"),
           py::arg("writes"), py::arg("cross_reads"), py::arg("frees"));

  py::class_<StreamRuntime>(m, "StreamRuntime")
      .def(py::init<std::vector<TaskSync>, int64_t, std::vector<int64_t>, std::vector<int64_t>, bool, int64_t,
                    py::object>(),
           py::arg("tasks"), py::arg("num_streams"), py::arg("side_outputs"), py::arg("output_slots"),
           py::arg("use_cuda"), py::arg("device") = 0, py::arg("ops") = py::none())
      .def("begin", &StreamRuntime::begin, py::arg("log"))
      .def("enter", &StreamRuntime::enter, py::arg("index"))
      .def("leave", &StreamRuntime::leave, py::arg("index"), py::arg("env"))
      .def("end", &StreamRuntime::end, py::arg("env"), py::arg("completed") = true)
      .def("take_log",
           [](StreamRuntime& self) {
             py::list out;
             for (auto& e : self.take_log()) {
               out.append(py::make_tuple(e.kind, e.stream, e.task, py::tuple(py::cast(e.slots)),
                                         py::tuple(py::cast(e.writes))));
             }
             return out;
           })
      .def_property_readonly("uses_cuda", &StreamRuntime::uses_cuda)
      .def_property_readonly("num_tasks", &StreamRuntime::num_tasks)
      .def_property_readonly("num_events", &StreamRuntime::num_events);
  // StreamRuntime(..., ops=...) drives its streams through a Python object (runtime.h).
  m.attr("stream_ops") = true;

  py::class_<StackGuard>(m, "StackGuard")
      .def(py::init<std::vector<at::Tensor>>(), py::arg("tensors"))
      .def("valid", &StackGuard::valid)
      .def("reset", &StackGuard::reset, py::arg("tensors"));

  py::class_<AddressGuard>(m, "AddressGuard")
      .def(py::init<std::vector<at::Tensor>>(), py::arg("tensors"))
      .def("valid", &AddressGuard::valid, "Whether every tensor still starts at the address it had.")
      .def("any_requires_grad", &AddressGuard::any_requires_grad, "Whether any of the tensors requires grad now.");

  py::class_<GradHandOff>(m, "GradHandOff")
      .def(py::init<std::vector<at::Tensor>, std::vector<int64_t>>(), py::arg("members"),
           py::arg("sizes") = std::vector<int64_t>{})
      .def("hooked", &GradHandOff::hooked, "Whether any member has a gradient hook a direct write would skip.")
      .def("accumulate", &GradHandOff::accumulate, py::arg("grad"),
           "Fill or accumulate every member's .grad from the stacked gradient; true if one add_ did it.");
}
