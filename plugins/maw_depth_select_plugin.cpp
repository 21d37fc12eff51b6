// attnx::MawDepthSelect plugin: shape/type validation at build time, the kernel at run time.
#include "maw_depth_select_plugin.h"

#include "attnx_kernels.h"

#include <cmath>
#include <cstring>
#include <new>

namespace attnx
{
namespace plugin
{
namespace
{
constexpr char const* kIoNames[] = {"q_depth", "k_depth", "policy_logits", "logits", "depth"};
constexpr int32_t kNbInputs = 3;
constexpr int32_t kNbOutputs = 2;
} // namespace

MawDepthSelectPlugin::MawDepthSelectPlugin(std::string nodeName, float scale)
    : PluginBase(kMawDepthSelectName, std::move(nodeName))
    , mScale(scale)
{
    mFields.emplace_back("scale", &mScale, nvinfer1::PluginFieldType::kFLOAT32, 1);
    mFieldCollection.nbFields = static_cast<int32_t>(mFields.size());
    mFieldCollection.fields = mFields.data();
}

nvinfer1::IPluginV3* MawDepthSelectPlugin::clone() noexcept
{
    try
    {
        return new MawDepthSelectPlugin(nodeName(), mScale);
    }
    catch (...)
    {
        return nullptr;
    }
}

std::string MawDepthSelectPlugin::checkShapes(
    nvinfer1::Dims const& q, nvinfer1::Dims const& k, nvinfer1::Dims const& policy)
{
    ShapeChecker c;
    bool const ranks = c.rank("q_depth", q, 4) & c.rank("k_depth", k, 4) & c.rank("policy_logits", policy, 2);
    if (!ranks)
    {
        return c.error();
    }
    c.same("batch size", "q_depth[0]", q.d[0], "k_depth[0]", k.d[0]);
    c.same("batch size", "q_depth[0]", q.d[0], "policy_logits[0]", policy.d[0]);
    c.same("number of heads", "q_depth[1]", q.d[1], "k_depth[1]", k.d[1]);
    c.same("depth size", "q_depth[3]", q.d[3], "k_depth[3]", k.d[3]);
    c.same("depth size", "q_depth[3]", q.d[3], "policy_logits[1]", policy.d[1]);
    c.atLeast("depth size policy_logits[1]", policy.d[1], 1);
    return c.error();
}

int32_t MawDepthSelectPlugin::getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
    nvinfer1::DataType const* inputTypes, int32_t nbInputs) const noexcept
{
    if (nbInputs != kNbInputs || nbOutputs != kNbOutputs || outputTypes == nullptr)
    {
        return fail("expects 3 inputs (q_depth, k_depth, policy_logits) and 2 outputs (logits, depth), got "
            + std::to_string(nbInputs) + " and " + std::to_string(nbOutputs));
    }
    if (checkInputTypes(inputTypes, nbInputs, kIoNames) != 0)
    {
        return -1;
    }
    outputTypes[0] = inputTypes[0];
    outputTypes[1] = nvinfer1::DataType::kINT64;
    return 0;
}

int32_t MawDepthSelectPlugin::getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
    nvinfer1::DimsExprs const* /*shapeInputs*/, int32_t /*nbShapeInputs*/, nvinfer1::DimsExprs* outputs,
    int32_t nbOutputs, nvinfer1::IExprBuilder& /*exprBuilder*/) noexcept
{
    try
    {
        if (nbInputs != kNbInputs || nbOutputs != kNbOutputs || inputs == nullptr || outputs == nullptr)
        {
            return fail("expects 3 inputs and 2 outputs, got " + std::to_string(nbInputs) + " and "
                + std::to_string(nbOutputs));
        }
        std::string const error
            = checkShapes(constantDims(inputs[0]), constantDims(inputs[1]), constantDims(inputs[2]));
        if (!error.empty())
        {
            return fail(error);
        }
        auto const& q = inputs[0];
        auto const& k = inputs[1];
        outputs[0].nbDims = 4;
        outputs[0].d[0] = q.d[0];
        outputs[0].d[1] = q.d[1];
        outputs[0].d[2] = q.d[2];
        outputs[0].d[3] = k.d[2];
        outputs[1].nbDims = 1;
        outputs[1].d[0] = q.d[0];
        return 0;
    }
    catch (...)
    {
        return fail("unexpected exception in getOutputShapes");
    }
}

bool MawDepthSelectPlugin::supportsFormatCombination(
    int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    if (nbInputs != kNbInputs || nbOutputs != kNbOutputs)
    {
        return false;
    }
    return supportsFloatAndInt64(pos, inOut, nbInputs, nbOutputs, /*firstInt64Output=*/1, kIoNames);
}

int32_t MawDepthSelectPlugin::configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
    nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept
{
    try
    {
        if (nbInputs != kNbInputs || nbOutputs != kNbOutputs || in == nullptr || out == nullptr)
        {
            return fail("expects 3 inputs and 2 outputs");
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

int32_t MawDepthSelectPlugin::onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs,
    nvinfer1::PluginTensorDesc const* /*out*/, int32_t nbOutputs) noexcept
{
    try
    {
        if (nbInputs != kNbInputs || nbOutputs != kNbOutputs || in == nullptr)
        {
            return fail("expects 3 inputs and 2 outputs");
        }
        std::string const error = checkShapes(in[0].dims, in[1].dims, in[2].dims);
        return error.empty() ? 0 : fail(error);
    }
    catch (...)
    {
        return fail("unexpected exception in onShapeChange");
    }
}

int32_t MawDepthSelectPlugin::enqueue(nvinfer1::PluginTensorDesc const* inputDesc,
    nvinfer1::PluginTensorDesc const* /*outputDesc*/, void const* const* inputs, void* const* outputs,
    void* /*workspace*/, cudaStream_t stream) noexcept
{
    auto const& q = inputDesc[0].dims;
    auto const& k = inputDesc[1].dims;
    int const dtype = kernelDtype(inputDesc[0].type);
    if (dtype < 0)
    {
        return fail(std::string("cannot run with ") + dataTypeName(inputDesc[0].type) + " inputs");
    }
    int const status = attnx_maw_depth_select(dtype, inputs[0], inputs[1], inputs[2], outputs[0],
        static_cast<int64_t*>(outputs[1]), q.d[0], q.d[1], q.d[2], k.d[2], q.d[3], mScale, stream);
    if (status != 0)
    {
        return fail("kernel launch failed (cudaError " + std::to_string(status) + ") for q_depth "
            + dimsToString(q) + ", k_depth " + dimsToString(k));
    }
    return 0;
}

nvinfer1::PluginFieldCollection const* MawDepthSelectPlugin::getFieldsToSerialize() noexcept
{
    return &mFieldCollection;
}

// ------------------------------------------------------------------------------------ creator

MawDepthSelectCreator::MawDepthSelectCreator()
{
    mFields.emplace_back("scale", nullptr, nvinfer1::PluginFieldType::kFLOAT32, 1);
    mFieldCollection.nbFields = static_cast<int32_t>(mFields.size());
    mFieldCollection.fields = mFields.data();
}

nvinfer1::IPluginV3* MawDepthSelectCreator::createPlugin(
    char const* name, nvinfer1::PluginFieldCollection const* fc, nvinfer1::TensorRTPhase /*phase*/) noexcept
{
    try
    {
        std::string const node = name != nullptr ? name : "";
        bool haveScale{false};
        double scale{0.0};
        if (fc != nullptr && fc->fields != nullptr)
        {
            for (int32_t i = 0; i < fc->nbFields; ++i)
            {
                auto const& field = fc->fields[i];
                if (field.name != nullptr && std::strcmp(field.name, "scale") == 0)
                {
                    if (!readScalarField(field, scale))
                    {
                        log(nvinfer1::ILogger::Severity::kERROR,
                            "attnx::MawDepthSelect node '" + node + "': attribute 'scale' must be a float");
                        return nullptr;
                    }
                    haveScale = true;
                }
            }
        }
        if (!haveScale || !std::isfinite(scale))
        {
            log(nvinfer1::ILogger::Severity::kERROR,
                "attnx::MawDepthSelect node '" + node + "': missing or non-finite float attribute 'scale'");
            return nullptr;
        }
        return new MawDepthSelectPlugin(node, static_cast<float>(scale));
    }
    catch (...)
    {
        return nullptr;
    }
}

} // namespace plugin
} // namespace attnx
