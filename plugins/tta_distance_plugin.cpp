// attnx::TtaDistance plugin: shape/type validation at build time, the kernels at run time.
#include "tta_distance_plugin.h"

#include "attnx_kernels.h"

#include <cstdint>
#include <new>

namespace attnx
{
namespace plugin
{
namespace
{
constexpr char const* kIoNames[] = {"q", "k", "trace", "dist"};
constexpr int32_t kNbInputs = 3;
constexpr int32_t kNbOutputs = 1;
constexpr size_t kWorkspaceAlignment = 256; // the kernels' workspace alignment
} // namespace

TtaDistancePlugin::TtaDistancePlugin(std::string nodeName)
    : PluginBase(kTtaDistanceName, std::move(nodeName))
{
}

nvinfer1::IPluginV3* TtaDistancePlugin::clone() noexcept
{
    try
    {
        return new TtaDistancePlugin(nodeName());
    }
    catch (...)
    {
        return nullptr;
    }
}

std::string TtaDistancePlugin::checkShapes(nvinfer1::Dims const& q, nvinfer1::Dims const& k, nvinfer1::Dims const& trace)
{
    ShapeChecker c;
    bool const ranks = c.rank("q", q, 4) & c.rank("k", k, 4) & c.rank("trace", trace, 4);
    if (!ranks)
    {
        return c.error();
    }
    c.same("batch size", "q[0]", q.d[0], "k[0]", k.d[0]);
    c.same("number of heads", "q[1]", q.d[1], "k[1]", k.d[1]);
    c.same("head size", "q[3]", q.d[3], "k[3]", k.d[3]);
    c.same("trace size", "trace[2]", trace.d[2], "the head size q[3]", q.d[3]);
    c.same("trace size", "trace[3]", trace.d[3], "the head size q[3]", q.d[3]);
    c.oneOr("trace heads", "trace[1]", trace.d[1], "the number of heads q[1]", q.d[1]);
    c.oneOr("trace batch", "trace[0]", trace.d[0], "the batch size q[0]", q.d[0]);
    c.atLeast("head size q[3]", q.d[3], 1);
    return c.error();
}

int32_t TtaDistancePlugin::getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
    nvinfer1::DataType const* inputTypes, int32_t nbInputs) const noexcept
{
    if (nbInputs != kNbInputs || nbOutputs != kNbOutputs || outputTypes == nullptr)
    {
        return fail("expects 3 inputs (q, k, trace) and 1 output (dist), got " + std::to_string(nbInputs) + " and "
            + std::to_string(nbOutputs));
    }
    if (checkInputTypes(inputTypes, nbInputs, kIoNames) != 0)
    {
        return -1;
    }
    outputTypes[0] = inputTypes[0];
    return 0;
}

int32_t TtaDistancePlugin::getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
    nvinfer1::DimsExprs const* /*shapeInputs*/, int32_t /*nbShapeInputs*/, nvinfer1::DimsExprs* outputs,
    int32_t nbOutputs, nvinfer1::IExprBuilder& /*exprBuilder*/) noexcept
{
    try
    {
        if (nbInputs != kNbInputs || nbOutputs != kNbOutputs || inputs == nullptr || outputs == nullptr)
        {
            return fail("expects 3 inputs and 1 output, got " + std::to_string(nbInputs) + " and "
                + std::to_string(nbOutputs));
        }
        std::string const error
            = checkShapes(constantDims(inputs[0]), constantDims(inputs[1]), constantDims(inputs[2]));
        if (!error.empty())
        {
            return fail(error);
        }
        outputs[0].nbDims = 4;
        outputs[0].d[0] = inputs[0].d[0];
        outputs[0].d[1] = inputs[0].d[1];
        outputs[0].d[2] = inputs[0].d[2];
        outputs[0].d[3] = inputs[1].d[2];
        return 0;
    }
    catch (...)
    {
        return fail("unexpected exception in getOutputShapes");
    }
}

bool TtaDistancePlugin::supportsFormatCombination(
    int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    if (nbInputs != kNbInputs || nbOutputs != kNbOutputs)
    {
        return false;
    }
    return supportsFloatAndInt64(pos, inOut, nbInputs, nbOutputs, /*firstInt64Output=*/-1, kIoNames);
}

int32_t TtaDistancePlugin::configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
    nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept
{
    try
    {
        if (nbInputs != kNbInputs || nbOutputs != kNbOutputs || in == nullptr || out == nullptr)
        {
            return fail("expects 3 inputs and 1 output");
        }
        nvinfer1::DataType const types[] = {in[0].desc.type, in[1].desc.type, in[2].desc.type};
        if (checkInputTypes(types, kNbInputs, kIoNames) != 0)
        {
            return -1;
        }
        for (bool const useMin : {true, false})
        {
            auto pick = [&](int32_t i) -> nvinfer1::Dims const& { return useMin ? in[i].min : in[i].max; };
            std::string const error = checkShapes(pick(0), pick(1), pick(2));
            if (!error.empty())
            {
                return fail(error + (useMin ? " (at the profile's min shapes)" : " (at the profile's max shapes)"));
            }
        }
        return 0;
    }
    catch (...)
    {
        return fail("unexpected exception in configurePlugin");
    }
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
    // + kWorkspaceAlignment: enqueue aligns TensorRT's pointer up to it.
    return attnx_tta_distance_workspace_size(q.d[0], q.d[1], t.d[0], t.d[1], q.d[2], k.d[2], q.d[3]) + kWorkspaceAlignment;
}

int32_t TtaDistancePlugin::onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs,
    nvinfer1::PluginTensorDesc const* /*out*/, int32_t nbOutputs) noexcept
{
    try
    {
        if (nbInputs != kNbInputs || nbOutputs != kNbOutputs || in == nullptr)
        {
            return fail("expects 3 inputs and 1 output");
        }
        std::string const error = checkShapes(in[0].dims, in[1].dims, in[2].dims);
        return error.empty() ? 0 : fail(error);
    }
    catch (...)
    {
        return fail("unexpected exception in onShapeChange");
    }
}

int32_t TtaDistancePlugin::enqueue(nvinfer1::PluginTensorDesc const* inputDesc,
    nvinfer1::PluginTensorDesc const* /*outputDesc*/, void const* const* inputs, void* const* outputs, void* workspace,
    cudaStream_t stream) noexcept
{
    auto const& q = inputDesc[0].dims;
    auto const& k = inputDesc[1].dims;
    auto const& t = inputDesc[2].dims;
    int const dtype = kernelDtype(inputDesc[0].type);
    if (dtype < 0)
    {
        return fail(std::string("cannot run with ") + dataTypeName(inputDesc[0].type) + " inputs");
    }
    size_t const needed = attnx_tta_distance_workspace_size(q.d[0], q.d[1], t.d[0], t.d[1], q.d[2], k.d[2], q.d[3]);
    auto const address = reinterpret_cast<uintptr_t>(workspace);
    void* aligned = reinterpret_cast<void*>((address + kWorkspaceAlignment - 1) / kWorkspaceAlignment * kWorkspaceAlignment);
    int const status = attnx_tta_distance(dtype, inputs[0], inputs[1], inputs[2], outputs[0], q.d[0], q.d[1], t.d[0],
        t.d[1], q.d[2], k.d[2], q.d[3], aligned, needed, stream);
    if (status != 0)
    {
        return fail("kernel launch failed (cudaError " + std::to_string(status) + ") for q " + dimsToString(q) + ", k "
            + dimsToString(k) + ", trace " + dimsToString(t));
    }
    return 0;
}

nvinfer1::PluginFieldCollection const* TtaDistancePlugin::getFieldsToSerialize() noexcept
{
    return &mFieldCollection;
}

// ------------------------------------------------------------------------------------ creator

nvinfer1::IPluginV3* TtaDistanceCreator::createPlugin(
    char const* name, nvinfer1::PluginFieldCollection const* /*fc*/, nvinfer1::TensorRTPhase /*phase*/) noexcept
{
    try
    {
        return new TtaDistancePlugin(name != nullptr ? name : "");
    }
    catch (...)
    {
        return nullptr;
    }
}

} // namespace plugin
} // namespace attnx
