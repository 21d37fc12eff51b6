// TensorRT IPluginV3 for attnx::MawDepthSelect (plugin "MawDepthSelect", version "1", namespace "attnx").
//
//   q_depth [B,H,Lq,d] T, k_depth [B,H,Lk,d] T, policy_logits [B,d] T; scale: float
//   -> logits [B,H,Lq,Lk] T, depth [B] int64          (T = float32 | float16, linear)
#ifndef ATTNX_MAW_DEPTH_SELECT_PLUGIN_H
#define ATTNX_MAW_DEPTH_SELECT_PLUGIN_H

#include "plugin_common.h"

namespace attnx
{
namespace plugin
{

constexpr char const* kMawDepthSelectName = "MawDepthSelect";

class MawDepthSelectPlugin final : public PluginBase
{
public:
    MawDepthSelectPlugin(std::string nodeName, float scale);

    // IPluginV3
    nvinfer1::IPluginV3* clone() noexcept override;

    // IPluginV3OneBuild
    int32_t getNbOutputs() const noexcept override
    {
        return 2;
    }
    int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
        nvinfer1::DataType const* inputTypes, int32_t nbInputs) const noexcept override;
    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs, nvinfer1::DimsExprs const* shapeInputs,
        int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
        nvinfer1::IExprBuilder& exprBuilder) noexcept override;
    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
        int32_t nbOutputs) noexcept override;
    int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override;

    // IPluginV3OneRuntime
    int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs, nvinfer1::PluginTensorDesc const* out,
        int32_t nbOutputs) noexcept override;
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override;

    //! Empty when q/k/policy dims are consistent (-1 = unknown, skipped), else the reasons.
    static std::string checkShapes(nvinfer1::Dims const& q, nvinfer1::Dims const& k, nvinfer1::Dims const& policy);

private:
    float mScale;
    std::vector<nvinfer1::PluginField> mFields;
    nvinfer1::PluginFieldCollection mFieldCollection{};
};

class MawDepthSelectCreator final : public nvinfer1::IPluginCreatorV3One
{
public:
    MawDepthSelectCreator();
    nvinfer1::IPluginV3* createPlugin(
        char const* name, nvinfer1::PluginFieldCollection const* fc, nvinfer1::TensorRTPhase phase) noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override
    {
        return &mFieldCollection;
    }
    char const* getPluginName() const noexcept override
    {
        return kMawDepthSelectName;
    }
    char const* getPluginVersion() const noexcept override
    {
        return kPluginVersion;
    }
    char const* getPluginNamespace() const noexcept override
    {
        return kPluginNamespace;
    }

private:
    std::vector<nvinfer1::PluginField> mFields;
    nvinfer1::PluginFieldCollection mFieldCollection{};
};

} // namespace plugin
} // namespace attnx

#endif // ATTNX_MAW_DEPTH_SELECT_PLUGIN_H
