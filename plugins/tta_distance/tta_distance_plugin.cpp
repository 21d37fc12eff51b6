// attnx::TtaDistance plugin: shape rules, workspace and kernel launch (the rest of the
// IPluginV3 is common/plugin_v3.h).
#include "tta_distance/tta_distance_plugin.h"

#include "tta_distance/tta_distance_kernel.h"

#include <cstdint>
#include <string>

namespace attnx
{
namespace plugin
{
namespace
{
constexpr size_t kWorkspaceAlignment = 256; // the kernels' workspace alignment
} // namespace

void TtaDistancePlugin::checkShapes(nvinfer1::Dims const* in, ShapeChecker& c)
{
    // Inputs 0 q [B,H,Lq,Dh], 1 k [B,H,Lk,Dh], 2 trace [B|1,H|1,Dh,Dh].
    int64_t const headSize = in[0].d[3];
    c.sameDims("batch size", in, {{0, 0}, {1, 0}}, kIoNames);
    c.sameDims("number of heads", in, {{0, 1}, {1, 1}}, kIoNames);
    c.sameDims("head size", in, {{0, 3}, {1, 3}}, kIoNames);
    for (int32_t axis : {2, 3})
    {
        std::string const name = "trace[" + std::to_string(axis) + "]";
        c.same("trace size", name.c_str(), in[2].d[axis], "the head size q[3]", headSize);
    }
    c.oneOr("trace heads", "trace[1]", in[2].d[1], "the number of heads q[1]", in[0].d[1]);
    c.oneOr("trace batch", "trace[0]", in[2].d[0], "the batch size q[0]", in[0].d[0]);
    c.atLeast("head size q[3]", headSize, 1);
}

void TtaDistancePlugin::outputShapes(
    nvinfer1::DimsExprs const* inputs, nvinfer1::DimsExprs* outputs, nvinfer1::IExprBuilder& /*exprBuilder*/)
{
    outputs[0].nbDims = 4; // dist [B, H, Lq, Lk]
    outputs[0].d[0] = inputs[0].d[0];
    outputs[0].d[1] = inputs[0].d[1];
    outputs[0].d[2] = inputs[0].d[2];
    outputs[0].d[3] = inputs[1].d[2];
}

size_t TtaDistancePlugin::getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
    nvinfer1::DynamicPluginTensorDesc const* /*outputs*/, int32_t /*nbOutputs*/) const noexcept
{
    if (inputs == nullptr || nbInputs != kNbInputs)
    {
        return 0;
    }
    // The workspace grows with every dimension, so the profile's max shapes bound it.
    auto const& q = inputs[0].max;
    auto const& k = inputs[1].max;
    auto const& t = inputs[2].max;
    if (q.nbDims != 4 || k.nbDims != 4 || t.nbDims != 4)
    {
        return 0;
    }
    // + kWorkspaceAlignment: launch aligns TensorRT's pointer up to it.
    return attnx_tta_distance_workspace_size(q.d[0], q.d[1], t.d[0], t.d[1], q.d[2], k.d[2], q.d[3]) + kWorkspaceAlignment;
}

int TtaDistancePlugin::launch(int dtype, nvinfer1::PluginTensorDesc const* inputDesc, void const* const* inputs,
    void* const* outputs, void* workspace, cudaStream_t stream) const noexcept
{
    auto const& q = inputDesc[0].dims;
    auto const& k = inputDesc[1].dims;
    auto const& t = inputDesc[2].dims;
    size_t const needed = attnx_tta_distance_workspace_size(q.d[0], q.d[1], t.d[0], t.d[1], q.d[2], k.d[2], q.d[3]);
    auto const address = reinterpret_cast<uintptr_t>(workspace);
    void* aligned = reinterpret_cast<void*>((address + kWorkspaceAlignment - 1) / kWorkspaceAlignment * kWorkspaceAlignment);
    return attnx_tta_distance(dtype, inputs[0], inputs[1], inputs[2], outputs[0], q.d[0], q.d[1], t.d[0], t.d[1], q.d[2],
        k.d[2], q.d[3], aligned, needed, stream);
}

} // namespace plugin
} // namespace attnx
